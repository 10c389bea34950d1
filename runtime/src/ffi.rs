//! Calling the C++ shim (csrc/): every shim function takes an error buffer and returns 0 or -1,
//! never letting a C++ exception through.

use std::ffi::{c_char, c_int, CStr};

use crate::error::{Result, RuntimeError};

/// Calls a shim function with an error buffer and turns its status into a `Result`.
pub(crate) fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    let mut err = [0 as c_char; 4096];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        Ok(())
    } else {
        // SAFETY: the shim NUL-terminates what it writes into the buffer.
        let text = unsafe { CStr::from_ptr(err.as_ptr()) };
        Err(RuntimeError::Torch(text.to_string_lossy().into_owned()))
    }
}

/// Writes `message` NUL-terminated into a shim's error buffer (for Rust callbacks).
pub(crate) fn write_error(message: &str, err: *mut c_char, err_len: usize) {
    if err.is_null() || err_len == 0 {
        return;
    }
    let bytes = message.as_bytes();
    let n = bytes.len().min(err_len - 1);
    // SAFETY: the caller passes a buffer of err_len bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
}

/// The text of a caught panic.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The `len` items at `data`, as a slice; empty when `len` is 0, where C++'s `vector::data()`
/// may be null (which `slice::from_raw_parts` must never get).
///
/// # Safety
/// When `len` > 0, `data` points to `len` initialised items that outlive the slice.
pub(crate) unsafe fn slice<'a, T>(data: *const T, len: usize) -> &'a [T] {
    if len == 0 || data.is_null() {
        &[]
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(data, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_vectors_null_data_is_an_empty_slice() {
        // SAFETY: length 0 with a null pointer is what the helper is for; then a real array.
        let empty: &[i64] = unsafe { slice(std::ptr::null(), 0) };
        assert!(empty.is_empty());
        let items = [1i64, 2, 3];
        assert_eq!(unsafe { slice(items.as_ptr(), 3) }, &items);
    }
}

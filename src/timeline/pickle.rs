//! A reader for the pickles libtorch writes (`torch::jit::Pickler`, protocol 2): dicts, lists,
//! tuples, strings, numbers, booleans and None, with memoized objects shared as the format
//! means them (a generic reader that treats shared memo entries as recursion loses the
//! snapshot's frames, whose keys are memoized once and referenced everywhere).

use std::cell::RefCell;
use std::rc::Rc;

/// A value read from a pickle.
#[derive(Debug, Clone)]
pub enum Value {
    /// `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer (larger ones than 64 bits are refused).
    Int(i64),
    /// A string.
    Str(Rc<str>),
    /// A float or bytes: read past, no snapshot field tchmem uses holds one.
    Other,
    /// A list (shared: memo references see later appends).
    List(Rc<RefCell<Vec<Value>>>),
    /// A tuple.
    Tuple(Rc<Vec<Value>>),
    /// A dict, in insertion order.
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
}

impl Value {
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is one (booleans count as 0/1).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// The value under string key `key`, if this is a dict that has it.
    pub fn get(&self, key: &str) -> Option<Value> {
        match self {
            Value::Dict(items) => items
                .borrow()
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v.clone()),
            _ => None,
        }
    }

    /// The items, if this is a list or a tuple.
    pub fn items(&self) -> Option<Vec<Value>> {
        match self {
            Value::List(items) => Some(items.borrow().clone()),
            Value::Tuple(items) => Some(items.as_ref().clone()),
            _ => None,
        }
    }
}

/// What is wrong with a pickle.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    /// It ended inside an instruction.
    #[error("the pickle ends early (at byte {0})")]
    Truncated(usize),
    /// An instruction this reader does not know (not one libtorch's snapshots use).
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {at}")]
    Unsupported {
        /// The opcode.
        opcode: u8,
        /// Where.
        at: usize,
    },
    /// The instructions do not make a value (an empty stack, a missing mark, a bad memo).
    #[error("malformed pickle at byte {0}")]
    Malformed(usize),
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or(PickleError::Truncated(self.at))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self, n: usize) -> Result<Value, PickleError> {
        let at = self.at;
        let bytes = self.take(n)?;
        let text = std::str::from_utf8(bytes).map_err(|_| PickleError::Malformed(at))?;
        Ok(Value::Str(text.into()))
    }
}

/// Reads one pickled value.
///
/// One function on purpose (it is longer than the others): the pickle machine is a loop over
/// opcodes with one stack and one memo, and each arm of the match is a line or two; split into
/// functions, every arm would take the stack, the memo and the reader as arguments and the
/// machine would no longer read as the protocol's table does.
pub fn read(bytes: &[u8]) -> Result<Value, PickleError> {
    let mut r = Reader { bytes, at: 0 };
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: Vec<Option<Value>> = Vec::new();
    let put = |memo: &mut Vec<Option<Value>>, id: usize, value: Value| {
        if memo.len() <= id {
            memo.resize(id + 1, None);
        }
        memo[id] = Some(value);
    };
    loop {
        let at = r.at;
        let bad = || PickleError::Malformed(at);
        let opcode = r.u8()?;
        match opcode {
            0x80 => {
                r.u8()?; // PROTO
            }
            0x95 => {
                r.u64()?; // FRAME
            }
            b'.' => return stack.pop().ok_or_else(bad),
            b'(' => marks.push(stack.len()),
            b'}' => stack.push(Value::Dict(Default::default())),
            b']' => stack.push(Value::List(Default::default())),
            b')' => stack.push(Value::Tuple(Rc::new(Vec::new()))),
            b'N' => stack.push(Value::None),
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'J' => stack.push(Value::Int(r.u32()? as i32 as i64)),
            b'K' => stack.push(Value::Int(r.u8()? as i64)),
            b'M' => stack.push(Value::Int(r.u16()? as i64)),
            0x8a => {
                // LONG1: little-endian two's complement of n bytes.
                let n = r.u8()? as usize;
                let digits = r.take(n)?;
                if n > 8 {
                    return Err(bad());
                }
                let mut buf = [if digits.last().is_some_and(|b| b & 0x80 != 0) {
                    0xff
                } else {
                    0
                }; 8];
                buf[..n].copy_from_slice(digits);
                stack.push(Value::Int(i64::from_le_bytes(buf)));
            }
            b'G' => {
                r.take(8)?;
                stack.push(Value::Other);
            }
            b'X' => {
                let n = r.u32()? as usize;
                stack.push(r.string(n)?);
            }
            0x8c => {
                let n = r.u8()? as usize;
                stack.push(r.string(n)?);
            }
            0x8d => {
                let n = r.u64()? as usize;
                stack.push(r.string(n)?);
            }
            b'B' | b'C' => {
                let n = if opcode == b'B' {
                    r.u32()? as usize
                } else {
                    r.u8()? as usize
                };
                r.take(n)?;
                stack.push(Value::Other);
            }
            b'q' => {
                let id = r.u8()? as usize;
                put(&mut memo, id, stack.last().cloned().ok_or_else(bad)?);
            }
            b'r' => {
                let id = r.u32()? as usize;
                put(&mut memo, id, stack.last().cloned().ok_or_else(bad)?);
            }
            0x94 => {
                let id = memo.len();
                put(&mut memo, id, stack.last().cloned().ok_or_else(bad)?);
            }
            b'h' | b'j' => {
                let id = if opcode == b'h' {
                    r.u8()? as usize
                } else {
                    r.u32()? as usize
                };
                let value = memo.get(id).cloned().flatten().ok_or_else(bad)?;
                stack.push(value);
            }
            b'a' => {
                let value = stack.pop().ok_or_else(bad)?;
                match stack.last() {
                    Some(Value::List(list)) => list.borrow_mut().push(value),
                    _ => return Err(bad()),
                }
            }
            b'e' => {
                let mark = marks.pop().ok_or_else(bad)?;
                let items = stack.split_off(mark);
                match stack.last() {
                    Some(Value::List(list)) => list.borrow_mut().extend(items),
                    _ => return Err(bad()),
                }
            }
            b's' => {
                let value = stack.pop().ok_or_else(bad)?;
                let key = stack.pop().ok_or_else(bad)?;
                match stack.last() {
                    Some(Value::Dict(dict)) => dict.borrow_mut().push((key, value)),
                    _ => return Err(bad()),
                }
            }
            b'u' => {
                let mark = marks.pop().ok_or_else(bad)?;
                let items = stack.split_off(mark);
                if !items.len().is_multiple_of(2) {
                    return Err(bad());
                }
                match stack.last() {
                    Some(Value::Dict(dict)) => {
                        let mut dict = dict.borrow_mut();
                        let mut items = items.into_iter();
                        while let (Some(k), Some(v)) = (items.next(), items.next()) {
                            dict.push((k, v));
                        }
                    }
                    _ => return Err(bad()),
                }
            }
            b't' => {
                let mark = marks.pop().ok_or_else(bad)?;
                let items = stack.split_off(mark);
                stack.push(Value::Tuple(Rc::new(items)));
            }
            0x85..=0x87 => {
                let n = (opcode - 0x84) as usize;
                if stack.len() < n {
                    return Err(bad());
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(Rc::new(items)));
            }
            _ => return Err(PickleError::Unsupported { opcode, at }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memo_entries_are_read_as_the_same_value_each_time() {
        // Python: pickle.dumps([{"name": "a"}, {"name": "b"}], protocol=2) with "name" memoized.
        let bytes = b"\x80\x02]q\x00(}q\x01X\x04\x00\x00\x00nameq\x02X\x01\x00\x00\x00aq\x03s}q\x04h\x02X\x01\x00\x00\x00bq\x05se.";
        let value = read(bytes).unwrap();
        let items = value.items().unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[1].get("name").unwrap().as_str(), Some("b"));
        assert!(matches!(read(b"\x80\x02]"), Err(PickleError::Truncated(_))));
        assert!(matches!(
            read(b"\x80\x02\xff."),
            Err(PickleError::Unsupported { opcode: 0xff, .. })
        ));
    }
}

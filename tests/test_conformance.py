"""The official jupyter_kernel_test suite, with every test that applies to a Rust kernel."""

import jupyter_kernel_test as jkt

from conftest import FIRST_CELL_TIMEOUT, KERNEL_NAME


class TchmemKernelTests(jkt.KernelTests):
    kernel_name = KERNEL_NAME
    language_name = "rust"
    file_extension = ".rs"

    code_hello_world = 'println!("hello, world");'
    code_stderr = 'eprintln!("to stderr");'

    completion_samples = [
        {"text": "let some_unique_name = 1;\nsome_uniq", "matches": {"some_unique_name"}},
        {"text": "std::collections::HashM"},
    ]

    complete_code_samples = [
        "1 + 1",
        "fn f() {}",
        'let s = "}";',
        "let c = '{';",
        ':dep rand = "0.8"\nrand::random::<u8>()',
        "%memprofile off\nlet x = 1;",
        "%%optimize --show\nlet x = 1;",
    ]
    incomplete_code_samples = ["fn f() {", "let v = vec![1,", 'let s = "open', "let x ="]
    invalid_code_samples = ["fn f() { )", "}", "let x = ;", "1 + / 2", "let = 5;"]

    code_generate_error = 'panic!("boom")'

    code_execute_result = [
        {"code": "6 * 7", "result": "42"},
        {"code": 'format!("{}-{}", "a", 1)', "result": '"a-1"'},
    ]

    code_display_data = [
        {"code": 'tchmem::display::html("<b>hi</b>")', "mime": "text/html"},
        # Printed the evcxr way (evcxr_runtime's mime_type helpers, plotters' evcxr feature).
        {
            "code": 'println!("EVCXR_BEGIN_CONTENT text/html\\n<b>hi</b>\\nEVCXR_END_CONTENT");',
            "mime": "text/html",
        },
        {
            "code": "tchmem::display::svg(\"<svg xmlns='http://www.w3.org/2000/svg'/>\")",
            "mime": "image/svg+xml",
        },
    ]

    code_history_pattern = "6 ?*"
    supported_history_operations = ("tail", "range", "search")

    code_inspect_sample = "std::vec::Vec::new"

    code_page_something = ":help"

    code_clear_output = "tchmem::display::clear_output(false)"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # Wait for the prelude (tch) to compile before the suite's 15 s timeouts apply.
        reply = cls.kc.execute_interactive("1", timeout=FIRST_CELL_TIMEOUT)
        assert reply["content"]["status"] == "ok", reply


class TchmemIopubWelcomeTests(jkt.IopubWelcomeTests):
    kernel_name = KERNEL_NAME
    support_iopub_welcome = True

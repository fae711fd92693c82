//! The assembler's `-Xptxas=-v` report, read per function. NVRTC puts it in the program log:
//!
//! ```text
//! ptxas info    : Compiling entry function 'warp_sum_bf16' for 'sm_90'
//! ptxas info    : Function properties for warp_sum_bf16
//! ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//! ptxas info    : Used 15 registers, used 1 barriers, 128 bytes smem
//! ```
//!
//! A field this parser does not know is skipped, so a newer ptxas that adds one still parses.

/// What ptxas reported for one function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The function's (mangled, unless `extern "C"`) name.
    pub name: String,
    /// A `__global__` kernel; `false` for a device function ptxas kept out of line.
    pub entry: bool,
    pub registers: u32,
    pub barriers: u32,
    /// Bytes of registers spilled to local memory and read back: 0 in a healthy kernel.
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    /// Static shared memory (`__shared__` arrays; dynamic shared memory is not counted).
    pub shared_bytes: u32,
    pub stack_bytes: u32,
}

impl KernelResources {
    /// Spilled bytes, stores and loads together.
    pub fn spill_bytes(&self) -> u32 {
        self.spill_store_bytes + self.spill_load_bytes
    }
}

/// Every function the report mentions, in the order it first mentions them.
pub fn parse(log: &str) -> Vec<KernelResources> {
    let mut functions: Vec<KernelResources> = Vec::new();
    let mut current: Option<usize> = None;
    for line in log.lines() {
        let Some(body) = line.strip_prefix("ptxas") else {
            continue;
        };
        let body = body
            .trim_start_matches([' ', 'i', 'n', 'f', 'o', ':', '.'])
            .trim();
        if let Some(rest) = body.strip_prefix("Compiling entry function '") {
            let name = rest.split('\'').next().unwrap_or_default();
            let index = function(&mut functions, name);
            functions[index].entry = true;
            current = Some(index);
        } else if let Some(name) = body.strip_prefix("Function properties for ") {
            current = Some(function(&mut functions, name.trim()));
        } else if let Some(index) = current {
            read_fields(body, &mut functions[index]);
        }
    }
    functions
}

/// The index of `name` in `functions`, added if new.
fn function(functions: &mut Vec<KernelResources>, name: &str) -> usize {
    match functions.iter().position(|f| f.name == name) {
        Some(index) => index,
        None => {
            functions.push(KernelResources {
                name: name.to_string(),
                ..KernelResources::default()
            });
            functions.len() - 1
        }
    }
}

/// Reads `N bytes stack frame, N bytes spill stores, …` and `Used N registers, used N
/// barriers, N bytes smem, …` into `function`.
fn read_fields(line: &str, function: &mut KernelResources) {
    for field in line.split(',') {
        let words: Vec<&str> = field.split_whitespace().collect();
        let (number, what) = match words.as_slice() {
            ["Used" | "used", n, what @ ..] => (n, what),
            [n, what @ ..] => (n, what),
            [] => continue,
        };
        let Ok(number) = number.parse::<u32>() else {
            continue;
        };
        let slot = match what {
            ["registers"] => &mut function.registers,
            ["barriers"] => &mut function.barriers,
            ["bytes", "stack", "frame"] => &mut function.stack_bytes,
            ["bytes", "spill", "stores"] => &mut function.spill_store_bytes,
            ["bytes", "spill", "loads"] => &mut function.spill_load_bytes,
            ["bytes", "smem"] => &mut function.shared_bytes,
            _ => continue,
        };
        *slot = number;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC 13.0's log for `kernels/tests/fixtures/warp_sum_bf16.cu`, and a second kernel
    /// that spills and calls an out-of-line device function (fields as ptxas prints them).
    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'warp_sum_bf16' for 'sm_90'
ptxas info    : Function properties for warp_sum_bf16
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 15 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compile time = 14.016 ms
ptxas info    : Function properties for _Z6helperf
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z5heavyPf' for 'sm_90'
ptxas info    : Function properties for _Z5heavyPf
ptxas         .     40 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 8 bytes cumulative stack size, 384 bytes cmem[0]
";

    #[test]
    fn each_function_gets_its_own_registers_spills_shared_memory_and_stack() {
        let functions = parse(LOG);
        assert_eq!(
            functions,
            vec![
                KernelResources {
                    name: "warp_sum_bf16".into(),
                    entry: true,
                    registers: 15,
                    barriers: 1,
                    shared_bytes: 128,
                    ..KernelResources::default()
                },
                KernelResources {
                    name: "_Z6helperf".into(),
                    stack_bytes: 16,
                    ..KernelResources::default()
                },
                KernelResources {
                    name: "_Z5heavyPf".into(),
                    entry: true,
                    registers: 255,
                    spill_store_bytes: 24,
                    spill_load_bytes: 32,
                    stack_bytes: 40,
                    ..KernelResources::default()
                },
            ]
        );
        assert_eq!(functions[2].spill_bytes(), 56);
    }

    #[test]
    fn a_log_without_a_report_has_no_functions() {
        assert!(parse("").is_empty());
        assert!(parse("bad.cu(1): warning: something\n").is_empty());
    }
}

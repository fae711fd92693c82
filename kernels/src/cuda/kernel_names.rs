//! The kernels a `.cu` source defines, by name. Shared with build.rs (through `#[path]`),
//! which registers the same kernels with the SIMT shim.

/// The names of a source's `extern "C" __global__ void NAME(` kernels, also when a
/// `__launch_bounds__(...)` stands before the name.
pub fn kernel_names(text: &str) -> Vec<String> {
    let marker = "extern \"C\" __global__ void ";
    text.match_indices(marker)
        .filter_map(|(at, _)| {
            let rest = text[at + marker.len()..].trim_start();
            let rest = match rest.strip_prefix("__launch_bounds__") {
                Some(bounds) => bounds.split_once(')')?.1.trim_start(),
                None => rest,
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// The parameter declarations of kernel `name` in `text`, e.g. `["const float* x", "int n"]`,
/// or `None` when `text` defines no such kernel.
pub fn kernel_params(text: &str, name: &str) -> Option<Vec<String>> {
    let marker = "extern \"C\" __global__ void ";
    text.match_indices(marker).find_map(|(at, _)| {
        let rest = text[at + marker.len()..].trim_start();
        let rest = match rest.strip_prefix("__launch_bounds__") {
            Some(bounds) => bounds.split_once(')')?.1.trim_start(),
            None => rest,
        };
        let list = rest.strip_prefix(name)?.trim_start().strip_prefix('(')?;
        let list = &list[..list.find(')')?];
        Some(
            list.split(',')
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|p| !p.is_empty())
                .collect(),
        )
    })
}

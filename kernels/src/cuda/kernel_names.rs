//! The kernels a `.cu` source defines, by name. Shared with build.rs (through `#[path]`),
//! which registers the same kernels with the SIMT shim.

/// Each `extern "C" __global__ void NAME(…)` kernel of `text`: its name and the text after it
/// (from its parameter list on), also when a `__launch_bounds__(...)` stands before the name.
fn kernels(text: &str) -> impl Iterator<Item = (&str, &str)> {
    let marker = "extern \"C\" __global__ void ";
    text.match_indices(marker).filter_map(move |(at, _)| {
        let rest = text[at + marker.len()..].trim_start();
        let rest = match rest.strip_prefix("__launch_bounds__") {
            Some(bounds) => bounds.split_once(')')?.1.trim_start(),
            None => rest,
        };
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        (end > 0).then(|| rest.split_at(end))
    })
}

/// The names of a source's kernels.
pub fn kernel_names(text: &str) -> Vec<String> {
    kernels(text).map(|(name, _)| name.to_string()).collect()
}

/// The parameter declarations of kernel `name` in `text`, e.g. `["const float* x", "int n"]`,
/// or `None` when `text` defines no such kernel.
pub fn kernel_params(text: &str, name: &str) -> Option<Vec<String>> {
    let (_, rest) = kernels(text).find(|(n, _)| *n == name)?;
    let list = rest.trim_start().strip_prefix('(')?;
    let list = &list[..list.find(')')?];
    Some(
        list.split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .collect(),
    )
}

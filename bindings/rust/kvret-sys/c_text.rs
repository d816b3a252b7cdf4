// C-text helpers shared by build.rs and tests/header.rs (both `include!` this file; neither may use crates).

/// The text of a C header with /* */ and // comments removed (line comments keep their newline).
#[allow(dead_code)]
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.map_or(true, |l| b < l) => {
                out.push_str(&rest[..b]);
                rest = rest[b + 2..].split_once("*/").map_or("", |(_, after)| after);
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].split_once('\n').map_or("", |(_, after)| after);
                out.push('\n');
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

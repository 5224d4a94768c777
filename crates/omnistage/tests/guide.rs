//! docs/guide.md shows code from the `upper` examples: every Rust block there must appear
//! verbatim (line by line, leading spaces ignored) in one of them, so the guide cannot drift
//! from code that CI builds and runs.

const EXAMPLES: [&str; 3] = [
    include_str!("../examples/upper_stages.rs"),
    include_str!("../examples/upper_tasks.rs"),
    include_str!("../examples/upper_common/mod.rs"),
];

fn lines(s: &str) -> Vec<&str> {
    s.lines().map(str::trim).collect()
}

#[test]
fn the_guides_code_is_the_examples_code() {
    let guide = include_str!("../../../docs/guide.md");
    let mut blocks = 0;
    let mut rest = guide;
    while let Some(start) = rest.find("```rust\n") {
        let body = &rest[start + 8..];
        let end = body.find("```").expect("closed code block");
        let block = lines(&body[..end]);
        assert!(
            EXAMPLES.iter().any(|ex| lines(ex)
                .windows(block.len())
                .any(|w| w == block.as_slice())),
            "this block of docs/guide.md is not in the examples:\n{}",
            &body[..end]
        );
        blocks += 1;
        rest = &body[end..];
    }
    assert!(blocks >= 2, "the guide shows code from both examples");
}

//! The `warren` binary: one Warren node (`warren::main`).

fn main() -> anyhow::Result<()> {
    warren::main()
}

//! The `warren` binary: one Warren node (`warren_node::main`).

fn main() -> anyhow::Result<()> {
    warren_node::main()
}

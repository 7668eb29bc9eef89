//! The document's scenario table (A-H): stop, steps, tool calls, tokens, seconds, effects.
//! Same output as `python3 scenario_table.py` in the reference.

fn main() {
    print!("{}", tether::sim::scenario_table());
}

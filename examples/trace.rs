//! Prints what `trace_demo.py` of the reference prints, computed by this crate's kernel.

fn main() {
    print!("{}", tether::sim::demos::trace_demo());
}

//! Prints what `context_growth_demo.py` of the reference prints, computed by this crate's kernel.

fn main() {
    print!("{}", tether::sim::demos::context_growth_demo());
}

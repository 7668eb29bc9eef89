//! Prints what `postmortem_demo.py` of the reference prints, computed by this crate's kernel.

fn main() {
    print!("{}", tether::sim::demos::postmortem_demo());
}

//! Prints what `resume_demo.py` of the reference prints, computed by this crate's kernel.

fn main() {
    print!("{}", tether::sim::demos::resume_demo());
}

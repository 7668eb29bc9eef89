//! Prints what `replay_demo.py` of the reference prints, computed by this crate's kernel.

fn main() {
    print!("{}", tether::sim::demos::replay_demo());
}

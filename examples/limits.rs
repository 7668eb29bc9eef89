//! Prints what the document's limits program prints, computed by this crate.

fn main() {
    print!("{}", tether::sim::demos::limits_demo());
}

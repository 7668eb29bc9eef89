//! Prints what the document's compounding program prints, computed by this crate.

fn main() {
    print!("{}", tether::sim::demos::compounding_demo());
}

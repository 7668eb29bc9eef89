//! Python's `random.Random`, bit for bit: MT19937 seeded the way CPython seeds it from an
//! integer, with `random()`, `getrandbits()` and `choice()` as CPython 3.11 computes them.
//!
//! It exists so that the design reference's 2,000-random-model workload runs here on the very same
//! replies as in the reference, and its stop distribution can be compared figure for figure.

const N: usize = 624;
const M: usize = 397;

pub struct PyRandom {
    mt: [u32; N],
    index: usize,
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> PyRandom {
        let mut key: Vec<u32> = Vec::with_capacity(2);
        let mut s = seed;
        while s > 0 {
            key.push(s as u32);
            s >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        let mut r = PyRandom {
            mt: [0; N],
            index: N,
        };
        r.init_by_array(&key);
        r
    }

    fn init_genrand(&mut self, s: u32) {
        self.mt[0] = s;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        // init_genrand(19650218) is the same for every seed: compute it once.
        static BASE: std::sync::OnceLock<[u32; N]> = std::sync::OnceLock::new();
        self.mt = *BASE.get_or_init(|| {
            let mut r = PyRandom {
                mt: [0; N],
                index: N,
            };
            r.init_genrand(19_650_218);
            r.mt
        });
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
        }
        self.mt[0] = 0x8000_0000;
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            let mt = &mut self.mt;
            let twist = |cur: u32, next: u32, far: u32| {
                let y = (cur & 0x8000_0000) | (next & 0x7fff_ffff);
                far ^ (y >> 1) ^ (if y & 1 == 1 { 0x9908_b0df } else { 0 })
            };
            for k in 0..N - M {
                mt[k] = twist(mt[k], mt[k + 1], mt[k + M]);
            }
            for k in N - M..N - 1 {
                mt[k] = twist(mt[k], mt[k + 1], mt[k + M - N]);
            }
            mt[N - 1] = twist(mt[N - 1], mt[0], mt[M - 1]);
            self.index = 0;
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// `random()`: a float in [0, 1) with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for 1 <= k <= 32.
    pub fn getrandbits(&mut self, k: u32) -> u32 {
        debug_assert!((1..=32).contains(&k));
        self.next_u32() >> (32 - k)
    }

    /// `_randbelow(n)` by rejection sampling on `n.bit_length()` bits.
    pub fn randbelow(&mut self, n: u32) -> u32 {
        debug_assert!(n > 0);
        let k = 32 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `choice(seq)`.
    pub fn choice<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.randbelow(items.len() as u32) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_cpython() {
        // python3 -c "import random; r=random.Random(42); print(r.random(), r.choice(range(5)), r.getrandbits(32))"
        let mut r = PyRandom::new(42);
        assert_eq!(r.random(), 0.6394267984578837);
        let items = [0, 1, 2, 3, 4];
        assert_eq!(*r.choice(&items), 0);
        assert_eq!(r.getrandbits(32), 3_184_935_163);
        // random.Random(0).random()
        assert_eq!(PyRandom::new(0).random(), 0.8444218515250481);
    }
}

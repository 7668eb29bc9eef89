//! Python's `random.Random`, bit for bit: MT19937 seeded the way CPython seeds it from an
//! integer, with `random()`, `getrandbits()` and `choice()` as CPython 3.11 computes them.
//!
//! It exists so that the design reference's 2,000-random-model workload runs here on the very same
//! replies as in the reference, and its stop distribution can be compared figure for figure.

const N: usize = 624;
const M: usize = 397;

pub struct PyRandom {
    /// Boxed: a generator is moved from the seeding into its model, and 2.5 KB of words
    /// copied at each move cost more than the allocation.
    mt: Box<[u32; N]>,
    /// The next word to temper and hand out.
    index: usize,
    /// How many words of the current generation are twisted. Words are twisted in chunks as
    /// they are needed (a run of the workload uses a few dozen of the 624), in the same order
    /// as the whole-array twist, so every word comes out the same.
    twisted: usize,
}

/// Words twisted at a time.
const CHUNK: usize = 32;

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> PyRandom {
        let [r] = PyRandom::many([seed]);
        r
    }

    /// `random.Random(seed)` for each of `L` seeds at once. CPython's seeding is one long chain
    /// of dependent multiplications per generator; running `L` chains in lockstep lets the CPU
    /// overlap them, so seeding many generators costs a fraction of seeding them one by one.
    pub fn many<const L: usize>(seeds: [u64; L]) -> [PyRandom; L] {
        // init_genrand(19650218) is the same for every seed: computed once.
        static BASE: std::sync::OnceLock<[u32; N]> = std::sync::OnceLock::new();
        let base = BASE.get_or_init(|| {
            let mut mt = [0u32; N];
            mt[0] = 19_650_218;
            for i in 1..N {
                let prev = mt[i - 1];
                mt[i] = 1_812_433_253u32
                    .wrapping_mul(prev ^ (prev >> 30))
                    .wrapping_add(i as u32);
            }
            mt
        });
        // The seed as 32-bit words, least significant first (`init_by_array`'s key; 0 is
        // [0]). A key has one or two words, so the word added at iteration k (plus its index
        // in the key) only depends on whether k is even or odd.
        let mut add = [[0u32; L]; 2];
        for (l, s) in seeds.iter().enumerate() {
            let (lo, hi) = (*s as u32, (*s >> 32) as u32);
            add[0][l] = lo;
            add[1][l] = if hi > 0 { hi.wrapping_add(1) } else { lo };
        }
        // Lanes side by side (`mt[i][l]` is word i of generator l), so each step of the chains
        // is one pass over L adjacent words that the compiler can vectorize.
        let mut mt: [[u32; L]; N] = std::array::from_fn(|i| [base[i]; L]);
        run_chains(&mut mt, &add);
        mt[0] = [0x8000_0000; L];
        // Each generator's words, row by row: reads are sequential, and so is each lane's
        // writing (a gather of one lane's words strided through the rows cost more).
        let mut out: [Box<[u32; N]>; L] = std::array::from_fn(|_| Box::new([0u32; N]));
        for (i, row) in mt.iter().enumerate() {
            for (o, w) in out.iter_mut().zip(row) {
                o[i] = *w;
            }
        }
        out.map(|words| PyRandom {
            mt: words,
            index: 0,
            twisted: 0,
        })
    }

    /// Twists the next chunk of the generation. The whole-array twist updates word k from
    /// words k and k+1 before their update and word k+M (k+M-N past the end, already updated):
    /// taking the words in order, chunk by chunk, reads exactly the same values.
    fn twist_chunk(&mut self) {
        let mt = &mut self.mt;
        let twist = |cur: u32, next: u32, far: u32| {
            let y = (cur & 0x8000_0000) | (next & 0x7fff_ffff);
            far ^ (y >> 1) ^ (if y & 1 == 1 { 0x9908_b0df } else { 0 })
        };
        let end = (self.twisted + CHUNK).min(N);
        for k in self.twisted..end {
            let next = mt[(k + 1) % N];
            let far = mt[(k + M) % N];
            mt[k] = twist(mt[k], next, far);
        }
        self.twisted = end;
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= self.twisted {
            if self.index >= N {
                self.index = 0;
                self.twisted = 0;
            }
            self.twist_chunk();
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

/// `init_by_array`'s two chains over `L` generators side by side: with AVX2 when the CPU has
/// it (eight 32-bit multiplications per instruction; the x86-64 baseline, SSE2, has no 32-bit
/// multiplication of lanes), otherwise as the baseline compiles it.
fn run_chains<const L: usize>(mt: &mut [[u32; L]; N], add: &[[u32; L]; 2]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `chains_avx2` only needs AVX2, which the CPU was just found to have.
        unsafe { chains_avx2(mt, add) };
        return;
    }
    chains(mt, add);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn chains_avx2<const L: usize>(mt: &mut [[u32; L]; N], add: &[[u32; L]; 2]) {
    chains(mt, add);
}

#[inline(always)]
fn chains<const L: usize>(mt: &mut [[u32; L]; N], add: &[[u32; L]; 2]) {
    let mut i = 1usize;
    // N >= any key length here, so the first loop always runs N times.
    for k in 0..N {
        let (prev, cur) = mt.split_at_mut(i);
        let (prev, cur, add) = (&prev[i - 1], &mut cur[0], &add[k & 1]);
        for l in 0..L {
            let p = prev[l];
            cur[l] = (cur[l] ^ (p ^ (p >> 30)).wrapping_mul(1_664_525)).wrapping_add(add[l]);
        }
        i += 1;
        if i >= N {
            mt[0] = mt[N - 1];
            i = 1;
        }
    }
    for _ in 0..N - 1 {
        let (prev, cur) = mt.split_at_mut(i);
        let (prev, cur) = (&prev[i - 1], &mut cur[0]);
        for l in 0..L {
            let p = prev[l];
            cur[l] = (cur[l] ^ (p ^ (p >> 30)).wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
        }
        i += 1;
        if i >= N {
            mt[0] = mt[N - 1];
            i = 1;
        }
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
        // python3 -c "import random; print(random.Random(2**40 + 5).random())": a two-word key.
        assert_eq!(PyRandom::new((1 << 40) + 5).random(), 0.5043802970418443);
    }

    #[test]
    fn words_twisted_chunk_by_chunk_equal_cpythons_across_generations() {
        // python3 -c "import random; r=random.Random(42); v=[r.getrandbits(32) for _ in range(1300)]; print(v[623], v[624], v[1299])"
        let mut r = PyRandom::new(42);
        let v: Vec<u32> = (0..1300).map(|_| r.getrandbits(32)).collect();
        assert_eq!(
            (v[623], v[624], v[1299]),
            (2_929_454_134, 1_071_722_055, 1_463_320_861)
        );
    }

    #[test]
    fn many_at_once_equal_one_by_one() {
        let seeds = [0, 1, 42, 1999, (1 << 40) + 5, u64::MAX, 7, 3];
        let mut many = PyRandom::many(seeds);
        // python3 -c "import random; print(random.Random(1999).random(), random.Random(2**64-1).random())"
        assert_eq!(PyRandom::new(1999).random(), 0.11693838502394582);
        assert_eq!(PyRandom::new(u64::MAX).random(), 0.021825695401270107);
        for (seed, r) in seeds.iter().zip(many.iter_mut()) {
            let mut one = PyRandom::new(*seed);
            for _ in 0..700 {
                assert_eq!(r.next_u32(), one.next_u32(), "seed {seed}");
            }
        }
    }

    #[test]
    fn both_ways_of_running_the_chains_agree() {
        // The dispatch (AVX2 where the CPU has it) against the baseline loop, on mixed seeds.
        let mut a = [[0u32; 16]; N];
        for (i, row) in a.iter_mut().enumerate() {
            for (l, w) in row.iter_mut().enumerate() {
                *w = (i as u32).wrapping_mul(2_654_435_761) ^ (l as u32).wrapping_mul(40_503);
            }
        }
        let add: [[u32; 16]; 2] =
            std::array::from_fn(|k| std::array::from_fn(|l| (k * 97 + l) as u32));
        let mut b = a;
        run_chains(&mut a, &add);
        chains(&mut b, &add);
        assert_eq!(a, b);
    }
}

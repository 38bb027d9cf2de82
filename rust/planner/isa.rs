//! The sweep compiled twice (issue 27): the portable build every x86-64 (and
//! every other target) runs, and on x86-64 a clone for the CPU features that
//! make it faster, chosen at run time, once per [`super::plan`] call.
//!
//! Nothing in the clone changes a figure: Rust never contracts `a * b + c`
//! into a fused multiply-add and the planner writes no `mul_add`, so both run
//! the same IEEE operations in the same order; the features only change how
//! they are encoded. Measured (benches/RESULTS.md, issue 27): AVX's VEX
//! encodings carry the gain (three operands, no false dependency on a
//! register's upper half), not FMA, BMI or POPCNT. Only what is inlined into
//! the clone gets them: hence the `#[inline(always)]` on the sweep's hot
//! callees, and methods rather than closures called from several places.
//! LLVM also leaves apart a call through `&dyn Fn` (so the chunk
//! distribution's builder is a generic), a recursive function (so the
//! wavelet histogram's walk keeps its own stack), std's `partition_point`,
//! `powi`'s compiler-rt call and the closures of `fold`, `min_by`,
//! `find_map`, `is_none_or` and `array::from_fn` (so the sweep writes loops):
//! `perf record --call-graph dwarf` of `planner_sweep_timing`, its samples
//! under `plan_x86_v3` tallied by their innermost frame, finds what is left
//! (benches/RESULTS.md, issue 27). The test `planner_fleets_dump` compares
//! both paths' dumps.

/// The instruction sets [`super::plan`] is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// The target's baseline (SSE2 on x86-64): any CPU.
    Portable,
    /// x86-64-v3's AVX2, FMA, BMI1/2 and LZCNT (SSE4.1 / 4.2 and POPCNT
    /// come with AVX): Intel since Haswell (2013), AMD since Excavator.
    #[cfg(target_arch = "x86_64")]
    X86V3,
}

impl Isa {
    /// The fastest set this CPU runs. `is_x86_feature_detected!` asks the CPU
    /// once per process and caches the answer (an atomic load per feature).
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("bmi1")
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("lzcnt")
            && std::is_x86_feature_detected!("popcnt")
        {
            return Self::X86V3;
        }
        Self::Portable
    }
}

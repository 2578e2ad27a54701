//! The core's integration tests, in one test binary: the fuzz corpus replayed through the
//! fuzz targets' checks, and property tests of the matcher.

mod fuzz_corpus;
mod matching_props;

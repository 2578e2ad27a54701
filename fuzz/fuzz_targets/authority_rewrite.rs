#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| credgate_fuzz::checks_api::authority_rewrite(data));

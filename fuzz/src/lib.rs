//! credgate's fuzz targets; what each checks is in `checks.rs`.
pub mod checks;
pub mod checks_api;

pub mod check;
pub mod ctl;
pub mod get;
pub mod matching;
pub mod serve;

//! One module per subcommand.

pub mod check;
pub mod get;
pub mod matching;

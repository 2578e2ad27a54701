//! The agent's integration tests, in one test binary: the API on a real unix socket (calls,
//! limits, faults, load), renewal, and the image access guard's store and API.

mod faults;
mod guard_api;
mod guard_store;
mod limits;
mod load;
mod renewal;
mod rpc;
mod store_props;

//! The image access guard at run time: durable records ([`store`]), the node's hashing key
//! ([`keys`]), and the service that decides and records ([`Guard`]).

pub mod keys;
pub mod store;

pub mod colour;
pub mod rng;

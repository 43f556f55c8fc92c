//! Samplers (diffusers "schedulers"): one file per algorithm, plus the shared
//! noise schedule and the seeded noise source.

pub mod ddim;
pub mod rng;
pub mod schedule;

pub use ddim::Ddim;
pub use rng::Rng;
pub use schedule::{PredictionType, ScheduleConfig, TimestepSpacing};

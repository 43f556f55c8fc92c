//! `brume serve` (being built).

//! The web editor's assets, embedded (being built).

//! Host memory for offloaded chunks (issue: host chunk pool). Placeholder until implemented.

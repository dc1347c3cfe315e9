//go:build race

package harness

// RaceEnabled reports a race-detector build: it slows CPU-bound code
// 5–10×, so CPU-time bounds are asserted with a wider margin under it.
const RaceEnabled = true

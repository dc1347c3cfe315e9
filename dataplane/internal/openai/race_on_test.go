//go:build race

package openai

// raceEnabled: the race detector slows CPU-bound code 5–10×; CPU-time
// bounds are asserted with a wider margin under it.
const raceEnabled = true

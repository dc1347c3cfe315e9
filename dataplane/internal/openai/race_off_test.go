//go:build !race

package openai

// raceEnabled: see race_on_test.go.
const raceEnabled = false

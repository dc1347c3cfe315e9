//go:build !race

package harness

// RaceEnabled: see race_on.go.
const RaceEnabled = false

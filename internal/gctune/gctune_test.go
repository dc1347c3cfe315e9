package gctune

import (
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPercentFor(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		live, roots, floor uint64
		base, want         int
	}{
		{0, 0, 64 * mib, 100, 100},              // no collection yet
		{4 * mib, 0, 64 * mib, 100, 1500},       // (64-4)/4
		{10 * mib, 0, 64 * mib, 100, 540},       // (64-10)/10
		{10 * mib, 2 * mib, 64 * mib, 100, 450}, // (64-10)/(10+2)
		{30 * mib, 0, 64 * mib, 100, 110},       // 113: within a tenth of base
		{32 * mib, 0, 64 * mib, 100, 100},       // GOGC alone reaches the floor
		{200 * mib, 0, 64 * mib, 100, 100},      // above the floor
		{10 * mib, 0, 64 * mib, 800, 800},       // never below the base
		{1024, 0, 64 * mib, 100, maxPercent},    // bounded
		{7 * mib, 0, 64 * mib, 100, 810},        // 814, in steps of 5
	} {
		require.Equal(t, c.want, percentFor(c.live, c.roots, c.floor, c.base), "%+v", c)
	}
}

// gcPercent reads GOGC without changing it.
func gcPercent() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

// collectUntil runs collections until cond holds (the tuner adjusts after
// each, from a cleanup), for up to 10 s.
func collectUntil(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), msg)
		runtime.GC()
		time.Sleep(time.Millisecond) // the cleanup goroutine runs
	}
}

var keep [][]byte

// TestStartFollowsTheLiveHeap: with a small live heap GOGC is raised to
// reach the floor; with a live heap above it GOGC returns to the base;
// stopping restores the base.
func TestStartFollowsTheLiveHeap(t *testing.T) {
	base := gcPercent()
	require.Positive(t, base, "the test needs the collector on")
	stop, err := Start(256 << 20)
	require.NoError(t, err)
	defer stop()
	collectUntil(t, func() bool { p, _ := Percent(); return p > base && gcPercent() == p },
		"GOGC raised for a small live heap")
	p, _ := Percent()
	t.Logf("GOGC %d for a small live heap (base %d)", p, base)
	// A live heap of 300 MiB: above the floor, GOGC alone does.
	for range 300 {
		keep = append(keep, make([]byte, 1<<20))
	}
	collectUntil(t, func() bool { p, _ := Percent(); return p == base && gcPercent() == base },
		"GOGC back to the base for a live heap above the floor")
	keep = nil
	collectUntil(t, func() bool { p, _ := Percent(); return p > base }, "GOGC raised again once the heap is small")
	stop()
	require.Equal(t, base, gcPercent(), "stop restores GOGC")
	p, _ = Percent()
	require.Equal(t, base, p)
	// A cleanup of the stopped tuner changes nothing.
	runtime.GC()
	runtime.GC()
	require.Equal(t, base, gcPercent())
}

// TestStartShared: two tuners at once share the process's GOGC, the larger
// floor applying; the last stop restores the base.
func TestStartShared(t *testing.T) {
	base := gcPercent()
	// A live heap of 8 MiB, so that neither floor's percent is bounded.
	for range 8 {
		keep = append(keep, make([]byte, 1<<20))
	}
	defer func() { keep = nil }()
	stopSmall, err := Start(32 << 20)
	require.NoError(t, err)
	defer stopSmall()
	collectUntil(t, func() bool { p, _ := Percent(); return p > base }, "raised by the first tuner")
	small, _ := Percent()
	stopLarge, err := Start(512 << 20)
	require.NoError(t, err)
	defer stopLarge()
	collectUntil(t, func() bool { p, _ := Percent(); return p > small }, "raised further by the larger floor")
	stopLarge()
	collectUntil(t, func() bool { p, _ := Percent(); return p < small*2 }, "back to the smaller floor's percent")
	require.Greater(t, gcPercent(), base, "the first tuner still runs")
	stopSmall()
	require.Equal(t, base, gcPercent())
}

func TestStartRefusesGCOffAndZero(t *testing.T) {
	_, err := Start(0)
	require.Error(t, err)
	old := debug.SetGCPercent(-1)
	defer debug.SetGCPercent(old)
	_, err = Start(64 << 20)
	require.ErrorIs(t, err, ErrGCOff)
}

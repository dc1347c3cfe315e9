// Package gctune gives a process's garbage collector a heap floor: while
// the live heap is small, GOGC is raised so that the heap may grow to
// about the floor before the next collection, instead of to twice a few
// megabytes.
//
// A data plane keeps little alive (its configuration, connections, the
// requests in flight) and allocates some kilobytes per request, all
// garbage once the request ends. With GOGC=100 and a live heap of a few
// megabytes the collector then runs every few megabytes of allocation —
// dozens of times a second under load — and its marking and assists take
// a fifth of the process's CPU (docs/limits.md, "The garbage collector").
// What a collection costs depends on the live heap, not on the garbage, so
// letting the heap grow to a floor of tens of megabytes makes collections
// that much rarer for the same work. Once the live heap is large enough
// that GOGC alone reaches the floor, the tuner changes nothing: memory
// stays bounded by max(floor, live × (1 + GOGC/100)), about.
//
// The runtime's heap goal is live + (live + stacks + globals) × GOGC/100
// (the stacks and globals it scans count since Go 1.18). The tuner reads
// those after every collection (runtime/metrics /gc/heap/live:bytes,
// /gc/scan/stack:bytes and /gc/scan/globals:bytes, from a cleanup that
// re-arms itself) and sets GOGC = max(base, (floor − live) × 100 /
// (live + stacks + globals)), base being GOGC as the process started (the
// GOGC environment variable, 100 by default): the goal is then the floor. A
// memory limit (GOMEMLIMIT) still applies: the runtime collects earlier
// when the heap nears it. With GOGC=off the tuner is not started
// (ErrGCOff).
package gctune

import (
	"errors"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// ErrGCOff is Start's error when the collector is off (GOGC=off): there is
// no percent to raise.
var ErrGCOff = errors.New("the garbage collector is off (GOGC=off): a heap floor does not apply")

// maxPercent bounds the GOGC the tuner sets (a live heap of a few hundred
// kilobytes right after start would otherwise ask for six digits).
const maxPercent = 50_000

// The live heap and the GC roots of the last collection.
var samples = []string{"/gc/heap/live:bytes", "/gc/scan/stack:bytes", "/gc/scan/globals:bytes"}

// tuner is the process's one tuner: GOGC is process-wide, so every Start
// shares it, and the largest floor of those running applies.
var tuner struct {
	mu      sync.Mutex
	floors  map[int]uint64 // by Start's handle
	next    int
	base    int // GOGC when the first Start ran
	percent int // what the tuner last set
	gen     int // a new generation on every start from none: an older chain of cleanups ends
	adjusts uint64
}

// Start raises GOGC while the live heap is below floor bytes (floor > 0),
// until stop is called; the last stop restores GOGC. Several may run at
// once (the largest floor applies).
func Start(floor uint64) (stop func(), err error) {
	if floor == 0 {
		return nil, errors.New("gctune: a heap floor of 0 bytes")
	}
	tuner.mu.Lock()
	defer tuner.mu.Unlock()
	if len(tuner.floors) == 0 {
		base := debug.SetGCPercent(100)
		debug.SetGCPercent(base)
		if base < 0 {
			return nil, ErrGCOff
		}
		tuner.base, tuner.percent = base, base
		tuner.floors = map[int]uint64{}
		tuner.gen++
		arm(tuner.gen)
	}
	id := tuner.next
	tuner.next++
	tuner.floors[id] = floor
	adjustLocked()
	var once sync.Once
	return func() {
		once.Do(func() {
			tuner.mu.Lock()
			defer tuner.mu.Unlock()
			delete(tuner.floors, id)
			if len(tuner.floors) == 0 {
				debug.SetGCPercent(tuner.base)
				tuner.percent = tuner.base
				return
			}
			adjustLocked()
		})
	}, nil
}

// Percent is the GOGC the tuner last set (GOGC as it is when none runs)
// and how many times the tuner has changed it.
func Percent() (percent int, adjusts uint64) {
	tuner.mu.Lock()
	defer tuner.mu.Unlock()
	if len(tuner.floors) == 0 {
		p := debug.SetGCPercent(100)
		debug.SetGCPercent(p)
		return p, tuner.adjusts
	}
	return tuner.percent, tuner.adjusts
}

// sentinel is an object nothing keeps alive: its cleanup runs after the
// collection that finds it unreachable. It has a pointer field so that it
// is not batched with other tiny objects (whose cleanups may be delayed).
type sentinel struct {
	_ *int
	_ [2]uintptr
}

// arm registers the cleanup that adjusts GOGC after the next collection
// and arms the one after.
func arm(gen int) {
	runtime.AddCleanup(new(sentinel), afterGC, gen)
}

func afterGC(gen int) {
	tuner.mu.Lock()
	defer tuner.mu.Unlock()
	if gen != tuner.gen || len(tuner.floors) == 0 {
		return // stopped (and maybe started again, with a chain of its own)
	}
	adjustLocked()
	arm(gen)
}

// adjustLocked sets GOGC for the live heap of the last collection.
func adjustLocked() {
	var floor uint64
	for _, f := range tuner.floors {
		floor = max(floor, f)
	}
	s := make([]metrics.Sample, len(samples))
	for i, n := range samples {
		s[i].Name = n
	}
	metrics.Read(s)
	var v [3]uint64
	for i := range s {
		if s[i].Value.Kind() == metrics.KindUint64 {
			v[i] = s[i].Value.Uint64()
		}
	}
	live, roots := v[0], v[1]+v[2]
	p := percentFor(live, roots, floor, tuner.base)
	if p != tuner.percent {
		debug.SetGCPercent(p)
		tuner.percent = p
		tuner.adjusts++
	}
}

// percentFor is the GOGC that makes the heap goal of a heap whose live
// part is live bytes, with roots bytes of stacks and globals, about floor
// bytes, never below base. Percents within a tenth of base's are rounded
// to it, and the result moves in steps of 5 % (so that a live heap moving
// by a few bytes does not change it after every collection).
func percentFor(live, roots, floor uint64, base int) int {
	if live == 0 || floor <= live {
		return base
	}
	want := (floor - live) * 100 / (live + roots)
	if want > maxPercent {
		return maxPercent
	}
	p := int(want)
	if p <= base+base/10 {
		return base
	}
	return p - p%5
}

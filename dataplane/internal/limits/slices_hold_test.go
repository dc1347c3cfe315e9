package limits

import (
	"context"
	"fmt"
	mathrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Budget and concurrency slices (issue 15; docs/limits.md, "Quota slices").

func hasTake(l *Lease, kind uint8) bool {
	for _, tk := range l.local {
		if tk.has(kind) {
			return true
		}
	}
	return false
}

// TestSlicesEveryKindZeroRoundTrips: once a hot scope holds slices of
// every kind, a request limited by rpm, tpm, concurrency and a budget at
// key, team and org level is admitted and settled without a single Redis
// call on the request path. After shutdown, Redis holds exactly the real
// spend (every reservation and unused slice went back) and no lease.
func TestSlicesEveryKindZeroRoundTrips(t *testing.T) {
	f := newSliceFleet(t, 1, 6*time.Second, 100*time.Millisecond, SliceConfig{Tick: 10 * time.Millisecond}, true)
	lim, cs := f.lims[0], f.counts[0]
	ctx := context.Background()
	bud := &Budget{CapMicros: 1e12, Window: "1d"}
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e7, TPM: 1e10, MaxParallel: 1e5, Budget: bud},
		{Kind: KindTeam, ID: "t", RPM: 1e7, TPM: 1e10, MaxParallel: 1e5, Budget: bud},
		{Kind: KindOrg, ID: f.b.org, RPM: 1e7, TPM: 1e10, MaxParallel: 1e5, Budget: bud},
	}
	const reserve, cost = 500, 200
	seq := 0
	admit := func() Decision {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: fmt.Sprintf("z%d", seq), Scopes: scopes, EstTokens: 100, MaxCostMicros: reserve})
		require.NoError(t, err)
		require.True(t, d.Allowed, "%+v", d.Rejection)
		return d
	}
	settle := func(d Decision) {
		_, err := lim.Settle(ctx, d.Lease, 60, cost)
		require.NoError(t, err)
	}
	// Warm up: demand makes the worker carve (two requests in flight, so
	// the concurrency demand is more than one).
	require.Eventually(t, func() bool {
		d1, d2 := admit(), admit()
		settle(d1)
		settle(d2)
		return len(d2.Lease.keys) == 0 && len(d1.Lease.keys) == 0
	}, 10*time.Second, time.Millisecond)
	admits, settles, carves := cs.count(admitScript), cs.count(settleScript), cs.count(carveScript)
	local, n := 0, 2000
	start := time.Now()
	for range n {
		d := admit()
		if len(d.Lease.keys) == 0 {
			require.True(t, hasTake(d.Lease, takeBudget) && hasTake(d.Lease, takePar) && hasTake(d.Lease, takeRate))
			require.True(t, d.Lease.Needs(), "a local lease settles its reservation and slot")
			st, err := lim.Renew(ctx, d.Lease)
			require.NoError(t, err)
			require.Equal(t, RenewExtended, st)
			local++
		}
		settle(d)
	}
	el := time.Since(start)
	exact := cs.count(admitScript) - admits
	require.Equal(t, n-local, exact, "every request that did not fit made exactly one admission call")
	require.Equal(t, exact, cs.count(settleScript)-settles, "requests from slices settle locally, the exact ones with one call")
	require.Greater(t, local, n*9/10, "requests admitted from slices")
	st := lim.SliceStats()
	t.Logf("%d requests in %s: %d from slices with 0 Redis calls, %d exact (1 call each); slice worker calls meanwhile: %d; held: %d µ$, %d slots",
		n, el.Round(time.Millisecond), local, exact, cs.count(carveScript)-carves, st.HeldBudgetMicros, st.HeldSlots)
	require.Positive(t, st.HeldSlots)
	require.Positive(t, st.HeldBudgetMicros)
	f.stop()
	// Shutdown gave every slice back: Redis holds the real spend of every
	// request, exactly, and no lease.
	st = lim.SliceStats()
	require.Zero(t, st.HeldBudgetMicros)
	require.Zero(t, st.HeldSlots)
	for _, sc := range scopes {
		s := f.b.state(t, sc)
		require.Equal(t, int64(cost*seq), s.Spend, "spend of %s", sc.Kind)
		require.Zero(t, s.Leases, "leases of %s", sc.Kind)
	}
}

// TestSlicesParallelAcrossThresholdNeverOverAdmit drives one concurrency
// cap from three limiters (three data planes): light load (slots from
// slices), then more requests in flight than the cap (slices shrink and
// stop; exact admission and rejections at the cap), then light load again
// (slices again). The requests in flight, counted across the fleet, never
// exceed the cap.
func TestSlicesParallelAcrossThresholdNeverOverAdmit(t *testing.T) {
	const limit = 40
	f := newSliceFleet(t, 3, 6*time.Second, 100*time.Millisecond, SliceConfig{MinParallel: 10, Tick: 10 * time.Millisecond}, true)
	scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: limit}, {Kind: KindOrg, ID: f.b.org, MaxParallel: 1e5}}
	phases := []int{3, 20, 3} // workers per limiter
	const phaseLen = 2 * time.Second
	var inflight, peak atomic.Int64
	type counts struct{ local, exact, rejected atomic.Int64 }
	per := make([]counts, len(phases))
	var phase atomic.Int64
	var seq atomic.Int64
	var wg sync.WaitGroup
	for li, lim := range f.lims {
		for w := range 20 {
			wg.Go(func() {
				rng := mathrand.New(mathrand.NewPCG(uint64(li), uint64(w)))
				for {
					p := int(phase.Load())
					if p >= len(phases) {
						return
					}
					if w >= phases[p] {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					d, err := lim.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("p%d", seq.Add(1)), Scopes: scopes})
					if err != nil || !d.Allowed {
						per[p].rejected.Add(1)
						time.Sleep(time.Duration(500+rng.IntN(1000)) * time.Microsecond)
						continue
					}
					n := inflight.Add(1)
					for {
						old := peak.Load()
						if n <= old || peak.CompareAndSwap(old, n) {
							break
						}
					}
					if hasTake(d.Lease, takePar) {
						per[p].local.Add(1)
					} else {
						per[p].exact.Add(1)
					}
					time.Sleep(time.Duration(1000+rng.IntN(4000)) * time.Microsecond)
					inflight.Add(-1)
					_, err = lim.Settle(context.Background(), d.Lease, 0, 0)
					require.NoError(t, err)
				}
			})
		}
	}
	for p := range phases {
		time.Sleep(phaseLen)
		phase.Store(int64(p + 1))
	}
	wg.Wait()
	for p := range phases {
		t.Logf("phase %d (%d requests wanted in flight): %d admitted from slots held, %d exact, %d rejected",
			p, 3*phases[p], per[p].local.Load(), per[p].exact.Load(), per[p].rejected.Load())
	}
	t.Logf("most requests in flight at once across the fleet: %d (cap %d)", peak.Load(), limit)
	require.LessOrEqual(t, peak.Load(), int64(limit), "requests in flight above the cap")
	require.Positive(t, per[0].local.Load(), "no slots from slices under light load")
	require.Positive(t, per[1].rejected.Load(), "the cap was never reached")
	require.Positive(t, per[1].exact.Load(), "no exact admission at the cap")
	require.Positive(t, per[2].local.Load(), "slices did not come back after the cap")
	require.GreaterOrEqual(t, peak.Load(), int64(limit*3/4), "the fleet never came near the cap")
	f.stop()
	s := f.b.state(t, scopes[0])
	require.Zero(t, s.Leases, "leases left after every request ended and the slices were given back")
}

// TestSlicesBudgetAcrossThresholdNeverOverAdmit drives one budget from
// three limiters until it is spent: budget slices while there is room,
// exact admission in its last part, then rejections. The real spend of
// every admitted request stays within exact admission's bound (cap plus
// one request's maximum cost), and once the limiters stop Redis holds
// exactly that spend.
func TestSlicesBudgetAcrossThresholdNeverOverAdmit(t *testing.T) {
	const limit, maxCost = 2_000_000, 2_000
	f := newSliceFleet(t, 3, 6*time.Second, 100*time.Millisecond, SliceConfig{MinBudgetMicros: 1000, Tick: 10 * time.Millisecond}, true)
	scopes := []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: limit, Window: "1d"}}}
	var spent, local, exact, rejected atomic.Int64
	var seq atomic.Int64
	deadline := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	for li, lim := range f.lims {
		for w := range 6 {
			wg.Go(func() {
				rng := mathrand.New(mathrand.NewPCG(uint64(li), uint64(w)))
				for time.Now().Before(deadline) {
					d, err := lim.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("b%d", seq.Add(1)),
						Scopes: scopes, MaxCostMicros: maxCost})
					if err != nil || !d.Allowed {
						rejected.Add(1)
						time.Sleep(time.Duration(500+rng.IntN(1000)) * time.Microsecond)
						continue
					}
					if hasTake(d.Lease, takeBudget) {
						local.Add(1)
					} else {
						exact.Add(1)
					}
					cost := int64(maxCost/2 + rng.IntN(maxCost/2+1))
					time.Sleep(time.Duration(rng.IntN(500)) * time.Microsecond)
					_, err = lim.Settle(context.Background(), d.Lease, 0, cost)
					require.NoError(t, err)
					spent.Add(cost)
				}
			})
		}
	}
	wg.Wait()
	t.Logf("spent %d µ$ of a %d µ$ budget: %d requests from budget slices, %d exact, %d rejected",
		spent.Load(), limit, local.Load(), exact.Load(), rejected.Load())
	require.LessOrEqual(t, spent.Load(), int64(limit+maxCost), "spend beyond exact admission's bound")
	require.Greater(t, spent.Load(), int64(limit*9/10), "the budget was not used")
	require.Positive(t, local.Load(), "no request from budget slices")
	require.Positive(t, exact.Load(), "no exact admission near the cap")
	require.Positive(t, rejected.Load(), "the budget was never exhausted")
	f.stop()
	require.Equal(t, spent.Load(), f.b.state(t, scopes[0]).Spend, "Redis's spend once every slice went back")
}

// TestSlicesDeadInstanceSlotsReturn: a limiter that dies holding
// concurrency slots (its worker stops without giving them back or renewing
// them) holds them only until their lease expires: meanwhile the fleet
// admits only what is left of the cap, then all of it.
func TestSlicesDeadInstanceSlotsReturn(t *testing.T) {
	const limit = 50
	const ttl = 2 * time.Second
	f := newSliceFleetCfg(t, 2, func(c *Config) { c.LeaseTTL, c.RenewInterval = ttl, 200*time.Millisecond },
		SliceConfig{MinParallel: 10, Tick: 10 * time.Millisecond, Share: 1}, false)
	dead, live := f.lims[0], f.lims[1]
	kill := deadWorker(dead) // the dead limiter's worker, stopped without release
	scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: limit}}
	var seq atomic.Int64
	admit := func(l *Limiter) *Lease {
		d, err := l.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("x%d", seq.Add(1)), Scopes: scopes})
		require.NoError(t, err)
		if !d.Allowed {
			return nil
		}
		return d.Lease
	}
	// Demand on the dead limiter: 12 requests in flight make it carve
	// slots; they end, and it keeps the slots (free) while demand lasts.
	require.Eventually(t, func() bool {
		var ls []*Lease
		for range 12 {
			if l := admit(dead); l != nil {
				ls = append(ls, l)
			}
		}
		for _, l := range ls {
			_, err := dead.Settle(context.Background(), l, 0, 0)
			require.NoError(t, err)
		}
		st := dead.SliceStats()
		return st.HeldSlots >= 12 && st.SlotsInUse == 0
	}, 5*time.Second, 5*time.Millisecond)
	kill()
	held := dead.SliceStats().HeldSlots
	died := time.Now()
	// The live limiter (exact: its worker is not running) fills the cap:
	// the dead one's slots count.
	var got []*Lease
	for {
		l := admit(live)
		if l == nil {
			break
		}
		got = append(got, l)
	}
	require.Equal(t, int64(limit), int64(len(got))+held, "the dead limiter's slots count against the cap")
	// Once their lease expires, the fleet has them back.
	require.Eventually(t, func() bool {
		l := admit(live)
		if l != nil {
			got = append(got, l)
		}
		return len(got) == limit
	}, ttl+time.Second, 5*time.Millisecond)
	back := time.Since(died)
	t.Logf("dead limiter held %d slots; the live one got %d at once and the cap (%d) %s after the death (lease TTL %s)",
		held, int64(limit)-held, limit, back.Round(time.Millisecond), ttl)
	require.Less(t, back, ttl+time.Second)
}

// TestSlicesHoldLimitsLoweredWithinASecond: two limiters admit a hot
// scope from concurrency and budget slices; its max_parallel_requests is
// lowered below the slicing threshold, then its budget cap below its
// spend (the new limits reach the data planes with the requests' scopes,
// as from a snapshot). After each change no request is admitted from a
// slice carved under the old limits, the fleet holds no free slot or
// budget slice within a second, concurrency stays within the new cap, and
// the lowered budget admits nothing.
func TestSlicesHoldLimitsLoweredWithinASecond(t *testing.T) {
	f := newSliceFleet(t, 2, 6*time.Second, 100*time.Millisecond, SliceConfig{MinParallel: 10, MinBudgetMicros: 1000, Tick: 10 * time.Millisecond}, true)
	var par, capM atomic.Int64
	par.Store(1000)
	capM.Store(1e12)
	var parAt, capAt atomic.Pointer[time.Time]
	var inflight, peakAfter atomic.Int64
	type ev struct {
		at               time.Time
		localPar, localB bool
	}
	var mu sync.Mutex
	var evs []ev
	var seq atomic.Int64
	stop := time.Now().Add(4500 * time.Millisecond)
	var wg sync.WaitGroup
	for li, lim := range f.lims {
		for w := range 4 {
			wg.Go(func() {
				rng := mathrand.New(mathrand.NewPCG(uint64(li), uint64(w)))
				for time.Now().Before(stop) {
					t0 := time.Now()
					scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: par.Load()},
						{Kind: KindTeam, ID: "t", Budget: &Budget{CapMicros: capM.Load(), Window: "1d"}}}
					d, err := lim.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("l%d", seq.Add(1)),
						Scopes: scopes, MaxCostMicros: 1000})
					if err != nil || !d.Allowed {
						time.Sleep(time.Duration(500+rng.IntN(1000)) * time.Microsecond)
						continue
					}
					n := inflight.Add(1)
					if p := parAt.Load(); p != nil && t0.After(p.Add(100*time.Millisecond)) {
						for {
							old := peakAfter.Load()
							if n <= old || peakAfter.CompareAndSwap(old, n) {
								break
							}
						}
					}
					mu.Lock()
					evs = append(evs, ev{at: t0, localPar: hasTake(d.Lease, takePar), localB: hasTake(d.Lease, takeBudget)})
					mu.Unlock()
					time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
					inflight.Add(-1)
					_, err = lim.Settle(context.Background(), d.Lease, 0, 500)
					require.NoError(t, err)
				}
			})
		}
	}
	time.Sleep(1500 * time.Millisecond)
	par.Store(5)
	now := time.Now()
	parAt.Store(&now)
	require.Eventually(t, func() bool {
		var free int64
		for _, l := range f.lims {
			st := l.SliceStats()
			free += st.HeldSlots - st.SlotsInUse
		}
		return free == 0
	}, time.Second, 5*time.Millisecond, "free slots still held a second after max_parallel_requests was lowered")
	time.Sleep(1500*time.Millisecond - time.Since(now))
	capM.Store(1)
	now2 := time.Now()
	capAt.Store(&now2)
	require.Eventually(t, func() bool {
		var b int64
		for _, l := range f.lims {
			b += l.SliceStats().HeldBudgetMicros
		}
		return b == 0
	}, time.Second, 5*time.Millisecond, "budget slices still held a second after the cap was lowered")
	wg.Wait()
	pa, ca := *parAt.Load(), *capAt.Load()
	var beforePar, localParAfter, beforeCap, localBAfter, afterCap int
	for _, e := range evs {
		switch {
		case e.at.Before(pa):
			if e.localPar {
				beforePar++
			}
		case e.localPar:
			localParAfter++
		}
		switch {
		case e.at.Before(ca):
			if e.localB {
				beforeCap++
			}
		default:
			afterCap++
			if e.localB {
				localBAfter++
			}
		}
	}
	t.Logf("%d admissions; slots from slices before the change %d, after %d; most in flight after it %d (new cap 5); "+
		"budget from slices before the cap change %d, admitted after it %d (%d from slices)",
		len(evs), beforePar, localParAfter, peakAfter.Load(), beforeCap, afterCap, localBAfter)
	require.Positive(t, beforePar, "the scope was not hot")
	require.Positive(t, beforeCap, "the budget was not sliced")
	require.Zero(t, localParAfter, "a slot carved under the old cap was used after the change")
	require.LessOrEqual(t, peakAfter.Load(), int64(5), "requests in flight above the lowered cap")
	require.Zero(t, localBAfter, "a budget slice carved under the old cap was used after the change")
	require.Zero(t, afterCap, "admitted after the cap fell below the spend")
}

// TestSlicesLongRequestSweepable: a request admitted entirely from slices
// makes no call while it is short; one that lives half a renew interval
// writes its record at its next renewal (with its report), so that when
// its data plane stops renewing it a sweeper hands back its usage event —
// charging nothing, since its reservation is in the slice — and its own
// late settlement finds it swept.
func TestSlicesLongRequestSweepable(t *testing.T) {
	f := newSliceFleetCfg(t, 1, func(c *Config) { c.LeaseTTL, c.RenewInterval = time.Second, 100*time.Millisecond },
		SliceConfig{Tick: 10 * time.Millisecond, MinBudgetMicros: 1000, MinParallel: 1}, true)
	lim := f.lims[0]
	ctx := context.Background()
	scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: 100, Budget: &Budget{CapMicros: 1e9, Window: "1d"}}}
	seq := 0
	admit := func() Decision {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: fmt.Sprintf("s%d", seq), Scopes: scopes, MaxCostMicros: 100,
			Report: &Report{Tokens: 5, CostMicros: 7, Event: []byte("usage event")}})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		return d
	}
	var d Decision
	require.Eventually(t, func() bool {
		d = admit()
		if len(d.Lease.keys) == 0 {
			return true
		}
		_, err := lim.Settle(ctx, d.Lease, 0, 50)
		require.NoError(t, err)
		return false
	}, 5*time.Second, time.Millisecond)
	require.True(t, d.Lease.Sweepable())
	rec := newKeyBuilder(f.b.prefix, f.b.org).record(d.Lease.requestID)
	// A renewal right away (a stream's, when its upstream answers) writes
	// nothing.
	st, err := lim.RenewReport(ctx, d.Lease, Report{Tokens: 6, CostMicros: 8, Event: []byte("usage event")})
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	require.Zero(t, f.b.rdb.Exists(ctx, rec).Val(), "a short request wrote a record")
	time.Sleep(60 * time.Millisecond)
	st, err = lim.RenewReport(ctx, d.Lease, Report{Tokens: 9, CostMicros: 11, Event: []byte("usage event")})
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	require.Equal(t, int64(1), f.b.rdb.Exists(ctx, rec).Val(), "the long request's record")
	// The scope has no more demand: its free budget slice goes back.
	require.Eventually(t, func() bool {
		st := lim.SliceStats()
		return st.HeldBudgetMicros == 0 && st.PendingReturns == 0 && st.InFlight == 0
	}, 3*time.Second, 10*time.Millisecond)
	spend := f.b.state(t, scopes[0]).Spend
	// No more renewals (as if its data plane had died): once its lease
	// expires a sweep settles it with its last report.
	var swept []Swept
	require.Eventually(t, func() bool {
		out, err := f.b.lim.Sweep(ctx, []string{f.b.org}, 0) // another data plane's sweeper
		require.NoError(t, err)
		swept = append(swept, out...)
		return len(swept) > 0
	}, 3*time.Second, 20*time.Millisecond)
	require.Len(t, swept, 1)
	require.Equal(t, d.Lease.requestID, swept[0].RequestID)
	require.Equal(t, []byte("usage event"), swept[0].Event)
	require.Equal(t, int64(11), swept[0].CostMicros)
	require.Equal(t, spend, f.b.state(t, scopes[0]).Spend, "the sweep charged the budget (the slice holds the reservation)")
	res, err := lim.Settle(ctx, d.Lease, 0, 50)
	require.NoError(t, err)
	require.True(t, res.Swept, "the late settlement finds the request swept")
}

// TestSlicesSlotsStopWithoutRenewal: slots whose lease the worker has not
// renewed for two renew intervals are not given to new requests (they are
// admitted exactly), and a request holding one is told to stop
// (RenewLost) a renew interval before the slot's lease can expire.
func TestSlicesSlotsStopWithoutRenewal(t *testing.T) {
	const ttl, iv = 2 * time.Second, 200 * time.Millisecond
	f := newSliceFleetCfg(t, 1, func(c *Config) { c.LeaseTTL, c.RenewInterval = ttl, iv },
		SliceConfig{MinParallel: 1, Tick: 10 * time.Millisecond}, false)
	lim := f.lims[0]
	ctx := context.Background()
	scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: 100}}
	seq := 0
	admit := func() *Lease {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: fmt.Sprintf("r%d", seq), Scopes: scopes})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		return d.Lease
	}
	first := admit() // exact: its demand makes the tick carve
	require.False(t, hasTake(first, takePar))
	lim.slices.tick(ctx, false)
	require.Positive(t, lim.SliceStats().HeldSlots)
	l := admit()
	require.True(t, hasTake(l, takePar), "a slot from the slice")
	base := time.Now()
	shift := func(d time.Duration) { lim.slices.now = func() time.Time { return time.Now().Add(d) } }
	shift(3 * iv) // no renewal for three renew intervals
	require.False(t, hasTake(admit(), takePar), "a slot not renewed for two renew intervals was given out")
	st, err := lim.Renew(ctx, l)
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st, "the slot's lease still has more than a renew interval left")
	shift(ttl - iv + time.Since(base))
	st, err = lim.Renew(ctx, l)
	require.NoError(t, err)
	require.Equal(t, RenewLost, st, "the request must stop before its slot's lease expires")
}

// TestSlicesUnseededBudgetCarvesOnceSeeded: a budget scope's first carve
// can find its window not yet seeded (the first exact admission is still
// fetching the ledger's spend). That carve gets nothing, and it must not
// back off as from a window without room (half a bucket: 5 s here): once
// the window is seeded, the scope's requests are admitted from a slice
// within a few ticks.
func TestSlicesUnseededBudgetCarvesOnceSeeded(t *testing.T) {
	f := newSliceFleet(t, 1, 60*time.Second, 10*time.Second, SliceConfig{Tick: 10 * time.Millisecond, MinBudgetMicros: 1000}, true)
	lim, cs := f.lims[0], f.counts[0]
	ctx := context.Background()
	gate := make(chan struct{})
	f.b.ledger.mu.Lock()
	f.b.ledger.gate = gate
	f.b.ledger.mu.Unlock()
	scopes := []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1e9, Window: "1d"}}}
	seq := 0
	admit := func() Decision {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: fmt.Sprintf("u%d", seq), Scopes: scopes, MaxCostMicros: 100})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		return d
	}
	// The first admission waits on the ledger for its seed, while its
	// demand has the worker carve from the unseeded window.
	first := make(chan Decision, 1)
	go func() {
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: "u0", Scopes: scopes, MaxCostMicros: 100})
		if err != nil || !d.Allowed {
			d = Decision{}
		}
		first <- d
	}()
	require.Eventually(t, func() bool {
		return cs.count(carveScript) > 0 && lim.SliceStats().InFlight == 0
	}, 5*time.Second, time.Millisecond, "a carve from the unseeded window")
	require.Zero(t, lim.SliceStats().HeldBudgetMicros, "nothing to carve from an unseeded window")
	close(gate)
	d0 := <-first
	require.True(t, d0.Allowed, "the first admission, once seeded")
	_, err := lim.Settle(ctx, d0.Lease, 0, 50)
	require.NoError(t, err)
	// Well within the 5 s a window without room would back off for.
	start := time.Now()
	require.Eventually(t, func() bool {
		d := admit()
		_, err := lim.Settle(ctx, d.Lease, 0, 50)
		require.NoError(t, err)
		return hasTake(d.Lease, takeBudget) && len(d.Lease.keys) == 0
	}, 2*time.Second, time.Millisecond, "a request admitted from a budget slice")
	t.Logf("admitted from a budget slice %s after the seed", time.Since(start).Round(time.Millisecond))
}

// TestSlicesUnseededBudgetSeededElsewhere: as above, but the window is
// seeded by another data plane while this one's own seed is still on its
// way: its worker finds the seeded window at its next carve, a tick
// later, not half a bucket (5 s) later.
func TestSlicesUnseededBudgetSeededElsewhere(t *testing.T) {
	f := newSliceFleet(t, 2, 60*time.Second, 10*time.Second, SliceConfig{Tick: 10 * time.Millisecond, MinBudgetMicros: 1000}, true)
	a, b := f.lims[0], f.lims[1]
	ctx := context.Background()
	gate := make(chan struct{})
	f.b.ledger.mu.Lock()
	f.b.ledger.gate = gate
	f.b.ledger.mu.Unlock()
	defer func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	}()
	scopes := []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1e9, Window: "1d"}}}
	first := make(chan Decision, 1)
	go func() {
		d, _ := a.Admit(ctx, Request{OrgID: f.b.org, RequestID: "a0", Scopes: scopes, MaxCostMicros: 100})
		first <- d
	}()
	require.Eventually(t, func() bool {
		return f.counts[0].count(carveScript) > 0 && a.SliceStats().InFlight == 0
	}, 5*time.Second, time.Millisecond, "a carve from the unseeded window")
	require.Zero(t, a.SliceStats().HeldBudgetMicros)
	// The other data plane seeds the window (its ledger call is not held).
	f.b.ledger.mu.Lock()
	f.b.ledger.gate = nil
	f.b.ledger.mu.Unlock()
	d, err := b.Admit(ctx, Request{OrgID: f.b.org, RequestID: "b0", Scopes: scopes, MaxCostMicros: 100})
	require.NoError(t, err)
	require.True(t, d.Allowed)
	_, err = b.Settle(ctx, d.Lease, 0, 50)
	require.NoError(t, err)
	start := time.Now()
	require.Eventually(t, func() bool { return a.SliceStats().HeldBudgetMicros > 0 }, 2*time.Second, time.Millisecond,
		"the first data plane carves from the window the other seeded")
	t.Logf("budget slice carved %s after the other data plane seeded the window", time.Since(start).Round(time.Millisecond))
	close(gate)
	d0 := <-first
	require.True(t, d0.Allowed, "the first admission, once its own seed is back")
	_, err = a.Settle(ctx, d0.Lease, 0, 50)
	require.NoError(t, err)
}

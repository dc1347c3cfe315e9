package limits

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkSlicedRequest is the limiter's CPU on the request path of a
// request admitted entirely from quota slices (issue 15, "limits at the
// speed of no limits"): rpm, tpm, concurrency and a budget at key, team
// and org level (12 limits in 3 scopes), as in make bench-limits. Each op
// is one Admit (with a sweepable report), one Renew of its lease and one
// SettleBatch of it, as the gateway makes them; ops that were not admitted
// entirely locally are counted (exact/op, which should be ~0).
func BenchmarkSlicedRequest(b *testing.B) {
	bb := setup(b, func(c *Config) { c.Slices = SliceConfig{Enabled: true} })
	lim := bb.lim
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = lim.RunSlices(ctx) }()
	b.Cleanup(func() { cancel(); wg.Wait() })
	all := func(kind, id string) Scope {
		return Scope{Kind: kind, ID: id, RPM: 1e10, TPM: 1e12, MaxParallel: 1e5, Budget: &Budget{CapMicros: 1e12, Window: "1d"}}
	}
	scopes := []Scope{all(KindKey, "k"), all(KindTeam, "t"), all(KindOrg, bb.org)}
	// Checked once, as the data plane's scope cache does.
	require.NoError(b, ValidateScopes(scopes))
	rep := Report{Tokens: 100, CostMicros: 300, Event: make([]byte, 200)}
	seq := 0
	one := func(renew bool) bool {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: bb.org, RequestID: "r" + strconv.Itoa(seq), Scopes: scopes,
			EstTokens: 150, MaxCostMicros: 400, Report: &rep, ScopesChecked: true})
		if err != nil || !d.Allowed {
			b.Fatalf("admit: %v %+v", err, d.Rejection)
		}
		local := d.Lease.Local() && !d.Lease.needs && len(d.Lease.keys) == 0
		if renew {
			if _, err := lim.Renew(ctx, d.Lease); err != nil {
				b.Fatal(err)
			}
		}
		_, errs := lim.SettleBatch(ctx, []SettleItem{{Lease: d.Lease, Tokens: 120, CostMicros: 350}})
		if errs[0] != nil {
			b.Fatal(errs[0])
		}
		return local
	}
	// Warm up: demand makes the worker carve every kind.
	deadline := time.Now().Add(10 * time.Second)
	for n := 0; n < 200; {
		if one(false) {
			n++
		} else {
			n = 0
			time.Sleep(time.Millisecond)
		}
		if time.Now().After(deadline) {
			b.Fatal("never admitted from slices")
		}
	}
	for _, renew := range []bool{false, true} {
		name := "admit_settle"
		if renew {
			name = "admit_renew_settle"
		}
		b.Run(name, func(b *testing.B) {
			exact := 0
			b.ReportAllocs()
			cpu0 := processCPU()
			for b.Loop() {
				if !one(renew) {
					exact++
				}
			}
			// The process's CPU per op (the slice worker's included): on a
			// shared machine ns/op is wall time, stretched by other load.
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(exact)/float64(b.N), "exact/op")
		})
	}
}

// processCPU is the process's user and system CPU so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// countReporter counts the reports built.
type countReporter struct{ n atomic.Int64 }

func (c *countReporter) Report() Report {
	c.n.Add(1)
	return Report{Tokens: 1, CostMicros: 1, Event: []byte("ev")}
}

// TestSlicesReporterAndSettleLocal: a request admitted entirely from
// slices builds no report (Request.Reporter is not called) and settles in
// process (SettleLocal, no Redis call; a second settlement is a no-op);
// an exact admission builds its report once, for its record.
func TestSlicesReporterAndSettleLocal(t *testing.T) {
	f := newSliceFleet(t, 1, 6*time.Second, 100*time.Millisecond, SliceConfig{Tick: 10 * time.Millisecond}, true)
	lim, cs := f.lims[0], f.counts[0]
	ctx := context.Background()
	scopes := []Scope{{Kind: KindKey, ID: "k", RPM: 1e7, TPM: 1e10, MaxParallel: 1000}}
	seq := 0
	var rep countReporter
	admit := func(sc []Scope) Decision {
		seq++
		d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: fmt.Sprintf("q%d", seq), Scopes: sc, EstTokens: 100, Reporter: &rep})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		return d
	}
	require.Eventually(t, func() bool {
		d := admit(scopes)
		_, err := lim.Settle(ctx, d.Lease, 60, 0)
		require.NoError(t, err)
		return d.Lease.Local() && !d.Lease.needs && d.Lease.keys == nil
	}, 10*time.Second, time.Millisecond)
	var d Decision
	for range 100 {
		if d = admit(scopes); d.Lease.Local() && !d.Lease.needs && d.Lease.keys == nil {
			break
		}
		_, err := lim.Settle(ctx, d.Lease, 60, 0)
		require.NoError(t, err)
	}
	require.True(t, d.Lease.Local() && !d.Lease.needs && d.Lease.keys == nil, "admitted from slices")
	require.True(t, d.Lease.Sweepable())
	n0, settles := rep.n.Load(), cs.count(settleScript)
	res, ok := lim.SettleLocal(SettleItem{Lease: d.Lease, Tokens: 60})
	require.True(t, ok)
	require.True(t, res.Applied)
	require.Equal(t, n0, rep.n.Load(), "no report built for a request admitted from slices")
	again, err := lim.Settle(ctx, d.Lease, 60, 0)
	require.NoError(t, err)
	require.False(t, again.Applied, "settled once")
	require.Equal(t, settles, cs.count(settleScript), "no settle call")
	_, ok = lim.SettleLocal(SettleItem{Lease: d.Lease, Tokens: 60})
	require.False(t, ok)

	// Below MinParallel: exact, with its report in its record.
	n0 = rep.n.Load()
	d = admit([]Scope{{Kind: KindKey, ID: "small", MaxParallel: 5}})
	require.False(t, d.Lease.Local())
	require.Equal(t, n0+1, rep.n.Load(), "the exact admission built its report once")
	_, ok = lim.SettleLocal(SettleItem{Lease: d.Lease})
	require.False(t, ok, "an exact lease settles in Redis")
	_, err = lim.Settle(ctx, d.Lease, 0, 0)
	require.NoError(t, err)
}

package limits

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkScripts measures what the scripts cost Redis: one admission and
// one settlement of a request limited at key, team and org level (rpm,
// tpm, parallel and budget each), sequentially, reporting Redis's own
// execution time per EVALSHA (INFO commandstats) and per request. The rate
// window is scaled down (61 buckets of 10 ms) so that windows are full, as
// under steady traffic, within the warm-up.
//
//	go test -run '^$' -bench BenchmarkScripts -benchtime 5000x ./dataplane/internal/limits/
func BenchmarkScripts(b *testing.B) { benchScripts(b, nil) }

// BenchmarkScriptsSlices is BenchmarkScripts with quota slices on (the
// slice worker running): rpm and tpm come from slices, so the admission
// checks only the budgets and leases, and the worker's carve.lua calls
// (counted too: they are EVALSHA) are shared by every request.
//
//	go test -run '^$' -bench BenchmarkScriptsSlices -benchtime 5000x ./dataplane/internal/limits/
func BenchmarkScriptsSlices(b *testing.B) { benchScriptsWith(b, nil, true) }

// benchScripts runs BenchmarkScripts; with rep, every request is admitted
// sweepable, with that report (BenchmarkScriptsSweepable,
// sweep_bench_test.go).
func benchScripts(b *testing.B, rep *Report) { benchScriptsWith(b, rep, false) }

func benchScriptsWith(b *testing.B, rep *Report, sliced bool) {
	bd := setup(b, func(c *Config) {
		c.rateWindow, c.rateBucket = 600*time.Millisecond, 10*time.Millisecond
		// A tick of a tenth of the (scaled-down) bucket, as 50 ms is of 1 s
		// by default; sequential requests here come at a rate far below a
		// loaded data plane's, so the worker's calls weigh more per request.
		c.Slices = SliceConfig{Enabled: sliced, Tick: time.Millisecond}
	})
	ctx := context.Background()
	if sliced {
		wctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = bd.lim.RunSlices(wctx) }()
		defer func() { stop(); <-done }()
	}
	bud := func() *Budget { return &Budget{CapMicros: 1e12, Window: "30d"} }
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindTeam, ID: "t", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindOrg, ID: bd.org, RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
	}
	start := time.Now()
	usec := func() (calls, usec int64) {
		info, err := bd.rdb.Info(ctx, "commandstats").Result()
		require.NoError(b, err)
		for _, line := range strings.Split(info, "\n") {
			if !strings.HasPrefix(line, "cmdstat_evalsha:") {
				continue
			}
			for _, kv := range strings.Split(strings.TrimSpace(strings.TrimPrefix(line, "cmdstat_evalsha:")), ",") {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseInt(v, 10, 64)
				switch k {
				case "calls":
					calls = n
				case "usec":
					usec = n
				}
			}
		}
		return calls, usec
	}
	// Warm up: scripts loaded, windows full.
	one := func(id string) {
		req := bd.req(id, 100, 1000, scopes...)
		req.Report = rep
		d := bd.admit(b, req)
		if !d.Allowed {
			b.Fatalf("rejected: %+v", d.Rejection)
		}
		if _, err := bd.lim.Settle(ctx, d.Lease, 90, 900); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; time.Since(start) < time.Second; i++ {
		one(fmt.Sprint("w", i))
	}
	c0, u0 := usec()
	b.ResetTimer()
	for i := range b.N {
		one(fmt.Sprint("r", i))
	}
	b.StopTimer()
	c1, u1 := usec()
	hk := newKeyBuilder(bd.prefix, bd.org).scope(&scopes[0])[0]
	b.Logf("state hash of %s: %d fields, encoding %s", scopes[0].ID, bd.rdb.HLen(ctx, hk).Val(), bd.rdb.ObjectEncoding(ctx, hk).Val())
	b.ReportMetric(float64(u1-u0)/float64(c1-c0), "redis_us/evalsha")
	b.ReportMetric(float64(u1-u0)/float64(b.N), "redis_us/request")
}

package limits

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
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
	bd := setupAt(b, startBenchRedis(b), func(c *Config) {
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
	usec := func() (calls, usec int64) { return evalshaStats(b, bd) }
	admit := func(id string) *Lease {
		req := bd.req(id, 100, 1000, scopes...)
		req.Report = rep
		d := bd.admit(b, req)
		if !d.Allowed {
			b.Fatalf("rejected: %+v", d.Rejection)
		}
		return d.Lease
	}
	settle := func(l *Lease) {
		if _, err := bd.lim.Settle(ctx, l, 90, 900); err != nil {
			b.Fatal(err)
		}
	}
	// Warm up: scripts loaded, windows full.
	for i := 0; time.Since(start) < time.Second; i++ {
		settle(admit(fmt.Sprint("w", i)))
	}
	// Requests are admitted and settled in groups of 8 (so that admissions
	// and settlements are measured apart; 8 leases in flight per scope).
	const group = 8
	var adUs, stUs int64
	c0, u0 := usec()
	cpu0 := redisCPU(b, bd)
	b.ResetTimer()
	leases := make([]*Lease, 0, group)
	for i := 0; i < b.N; {
		leases = leases[:0]
		_, ua := usec()
		for ; len(leases) < group && i < b.N; i++ {
			leases = append(leases, admit(fmt.Sprint("r", i)))
		}
		_, ub := usec()
		for _, l := range leases {
			settle(l)
		}
		_, uc := usec()
		// Each usec() is itself one INFO call, not an EVALSHA.
		adUs += ub - ua
		stUs += uc - ub
	}
	b.StopTimer()
	c1, u1 := usec()
	b.ReportMetric(float64(redisCPU(b, bd)-cpu0)/float64(b.N), "redis_cpu_us/request")
	hk := newKeyBuilder(bd.prefix, bd.org).scope(&scopes[0])[0]
	b.Logf("state hash of %s: %d fields, encoding %s", scopes[0].ID, bd.rdb.HLen(ctx, hk).Val(), bd.rdb.ObjectEncoding(ctx, hk).Val())
	b.ReportMetric(float64(u1-u0)/float64(c1-c0), "redis_us/evalsha")
	b.ReportMetric(float64(u1-u0)/float64(b.N), "redis_us/request")
	b.ReportMetric(float64(adUs)/float64(b.N), "admit_us/request")
	b.ReportMetric(float64(stUs)/float64(b.N), "settle_us/request")
}

// startBenchRedis starts a redis-server of the benchmark's own on a free
// loopback port (stopped at cleanup) and returns its address: INFO
// commandstats counts every client's calls, and the machine's Redis is
// shared with other tests.
func startBenchRedis(b testing.TB) string {
	b.Helper()
	bin, err := exec.LookPath("redis-server")
	require.NoError(b, err, "the script benchmarks need redis-server on PATH")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(b, ln.Close())
	addr := "127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", b.TempDir(),
		"--save", "", "--appendonly", "no")
	require.NoError(b, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	b.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	require.True(b, testsvc.Until(func() bool { return c.Ping(context.Background()).Err() == nil }, 10*time.Second, 10*time.Millisecond),
		"redis-server on %s did not answer", addr)
	return addr
}

// BenchmarkScriptsConcurrent is BenchmarkScripts with 32 admissions of
// the org at a time (groups of 1,000 requests admitted, then settled, each
// settlement on its own), with admissions batched (admitbatch.go) and
// unbatched (one call each): what the batching saves Redis per request.
//
//	go test -run '^$' -bench BenchmarkScriptsConcurrent -benchtime 5000x ./dataplane/internal/limits/
func BenchmarkScriptsConcurrent(b *testing.B) {
	for _, c := range []struct {
		name      string
		unbatched bool
	}{{"batched", false}, {"unbatched", true}} {
		b.Run(c.name, func(b *testing.B) {
			bd := setupAt(b, startBenchRedis(b), func(cfg *Config) {
				cfg.rateWindow, cfg.rateBucket = 600*time.Millisecond, 10*time.Millisecond
				cfg.admitUnbatched = c.unbatched
			})
			ctx := context.Background()
			bud := func() *Budget { return &Budget{CapMicros: 1e12, Window: "30d"} }
			scopes := []Scope{
				{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
				{Kind: KindTeam, ID: "t", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
				{Kind: KindOrg, ID: bd.org, RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
			}
			// par runs f(i) for i in 1..n on 32 goroutines.
			par := func(n int, f func(i int) bool) {
				var next atomic.Int64
				var wg sync.WaitGroup
				for range 32 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							i := int(next.Add(1))
							if i > n || !f(i) {
								return
							}
						}
					}()
				}
				wg.Wait()
			}
			// run admits n requests concurrently, then settles them
			// concurrently, and returns the Redis time each phase took.
			run := func(n int, prefix string) (admitUs, settleUs int64) {
				leases := make([]*Lease, n+1)
				_, u0 := evalshaStats(b, bd)
				par(n, func(i int) bool {
					d, err := bd.lim.Admit(ctx, bd.req(prefix+strconv.Itoa(i), 100, 1000, scopes...))
					if err != nil || !d.Allowed {
						b.Errorf("admit: %v %+v", err, d.Rejection)
						return false
					}
					leases[i] = d.Lease
					return true
				})
				_, u1 := evalshaStats(b, bd)
				par(n, func(i int) bool {
					if _, err := bd.lim.Settle(ctx, leases[i], 90, 900); err != nil {
						b.Error(err)
						return false
					}
					return true
				})
				_, u2 := evalshaStats(b, bd)
				return u1 - u0, u2 - u1
			}
			run(2000, "w") // warm up: scripts loaded, windows full
			c0, _ := evalshaStats(b, bd)
			cpu0 := redisCPU(b, bd)
			b.ResetTimer()
			var ad, st int64
			for i := 0; i < b.N; i += 1000 {
				a, s := run(min(1000, b.N-i), fmt.Sprint("r", i, "-"))
				ad, st = ad+a, st+s
			}
			b.StopTimer()
			c1, _ := evalshaStats(b, bd)
			b.ReportMetric(float64(redisCPU(b, bd)-cpu0)/float64(b.N), "redis_cpu_us/request")
			b.ReportMetric(float64(ad+st)/float64(b.N), "redis_us/request")
			b.ReportMetric(float64(ad)/float64(b.N), "admit_us/request")
			b.ReportMetric(float64(st)/float64(b.N), "settle_us/request")
			b.ReportMetric(float64(c1-c0)/float64(b.N), "evalsha/request")
		})
	}
}

// BenchmarkScriptsRenew measures what renewals cost Redis: 32 live
// sweepable requests of one org, limited at key, team and org level (every
// limit), renewed together by RenewBatch as the shared renewal tick does,
// each with a new report. batched folds them into one renew.lua call;
// unbatched makes one call per request (pipelined), as before renewals
// were folded. Reported per renewal.
//
//	go test -run '^$' -bench BenchmarkScriptsRenew -benchtime 500x ./dataplane/internal/limits/
func BenchmarkScriptsRenew(b *testing.B) {
	for _, c := range []struct {
		name      string
		unbatched bool
	}{{"batched", false}, {"unbatched", true}} {
		b.Run(c.name, func(b *testing.B) {
			bd := setupAt(b, startBenchRedis(b), func(cfg *Config) {
				cfg.rateWindow, cfg.rateBucket = 600*time.Millisecond, 10*time.Millisecond
				cfg.renewUnbatched = c.unbatched
			})
			ctx := context.Background()
			bud := func() *Budget { return &Budget{CapMicros: 1e12, Window: "30d"} }
			scopes := []Scope{
				{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
				{Kind: KindTeam, ID: "t", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
				{Kind: KindOrg, ID: bd.org, RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
			}
			const live = 32
			items := make([]RenewItem, live)
			for i := range items {
				req := bd.req(fmt.Sprint("r", i), 100, 1000, scopes...)
				rep := benchReport
				req.Report = &rep
				d := bd.admit(b, req)
				require.True(b, d.Allowed)
				items[i] = RenewItem{Lease: d.Lease}
			}
			renew := func(n int) {
				for i := range items {
					rep := benchReport
					rep.Tokens += int64(n)
					items[i].Report = &rep
				}
				states, errs := bd.lim.RenewBatch(ctx, items)
				for i := range items {
					if errs[i] != nil || states[i] != RenewExtended {
						b.Fatalf("renew %d: %v %v", i, states[i], errs[i])
					}
				}
			}
			for i := range 20 {
				renew(i) // warm up: the script loaded
			}
			c0, u0 := evalshaStats(b, bd)
			cpu0 := redisCPU(b, bd)
			b.ResetTimer()
			for i := range b.N {
				renew(i)
			}
			b.StopTimer()
			c1, u1 := evalshaStats(b, bd)
			n := float64(b.N * live)
			b.ReportMetric(float64(redisCPU(b, bd)-cpu0)/n, "redis_cpu_us/renewal")
			b.ReportMetric(float64(u1-u0)/n, "redis_us/renewal")
			b.ReportMetric(float64(c1-c0)/n, "evalsha/renewal")
		})
	}
}

package limits

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// benchReport is a report the size of a real one: the proxy's usage event
// of a chat stream marshals to about 300 bytes.
var benchReport = Report{Tokens: 1234, CostMicros: 5678, Event: bytes.Repeat([]byte("e"), 300)}

// BenchmarkScriptsSweepable is BenchmarkScripts with every request
// admitted sweepable (its record carries a report the size of a real one,
// and it joins the lease index; the settlement leaves the index). Compare
// redis_us/request with BenchmarkScripts; BenchmarkRenew measures what a
// renewal with a report costs.
//
//	go test -run '^$' -bench 'BenchmarkScripts' -benchtime 5000x ./dataplane/internal/limits/
func BenchmarkScriptsSweepable(b *testing.B) { benchScripts(b, &benchReport) }

// BenchmarkRenew measures one renewal (round trip included) of a lease on
// the four scopes of BenchmarkAdmitSettle: plain, and carrying a report.
func BenchmarkRenew(b *testing.B) {
	bb := setup(b, func(c *Config) { c.CallTimeout = time.Second })
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "30d"}},
		{Kind: KindTeam, ID: "t", RPM: 1e9, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
		{Kind: KindUser, ID: "u", Budget: &Budget{CapMicros: 1e15, Window: "1d"}},
		{Kind: KindOrg, ID: "o", TPM: 1e12, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
	}
	ctx := context.Background()
	for _, c := range []struct {
		name string
		rep  *Report
	}{{"plain", nil}, {"report", &benchReport}} {
		b.Run(c.name, func(b *testing.B) {
			req := bb.req("renew-"+c.name, 100, 1000, scopes...)
			req.Report = c.rep
			d := bb.admit(b, req)
			c0, u0 := evalshaStats(b, bb)
			for b.Loop() {
				var err error
				if c.rep != nil {
					_, err = bb.lim.RenewReport(ctx, d.Lease, *c.rep)
				} else {
					_, err = bb.lim.Renew(ctx, d.Lease)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			c1, u1 := evalshaStats(b, bb)
			b.ReportMetric(float64(u1-u0)/float64(c1-c0), "redis_us/evalsha")
		})
	}
}

// BenchmarkAdmitSettleSweepable is the admit_settle case of
// BenchmarkAdmitSettle with the request admitted sweepable.
func BenchmarkAdmitSettleSweepable(b *testing.B) {
	bb := setup(b, func(c *Config) { c.CallTimeout = time.Second })
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "30d"}},
		{Kind: KindTeam, ID: "t", RPM: 1e9, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
		{Kind: KindUser, ID: "u", Budget: &Budget{CapMicros: 1e15, Window: "1d"}},
		{Kind: KindOrg, ID: "o", TPM: 1e12, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
	}
	ctx := context.Background()
	var n atomic.Int64
	for b.Loop() {
		req := bb.req(strconv.FormatInt(n.Add(1), 10), 100, 1000, scopes...)
		req.Report = &benchReport
		d, err := bb.lim.Admit(ctx, req)
		if err != nil || !d.Allowed {
			b.Fatalf("admit: %v %+v", err, d.Rejection)
		}
		if _, err := bb.lim.Settle(ctx, d.Lease, 80, 700); err != nil {
			b.Fatal(err)
		}
	}
}

// redisCPU returns the CPU time (µs) Redis's main thread used so far
// (INFO cpu: scripts, and reading and answering commands), which unlike
// commandstats' wall time does not count the time the thread was
// preempted on a loaded machine.
func redisCPU(b *testing.B, bd *bundle) int64 {
	info, err := bd.rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var sec float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys_main_thread" || k == "used_cpu_user_main_thread") {
			f, _ := strconv.ParseFloat(v, 64)
			sec += f
		}
	}
	return int64(sec * 1e6)
}

// evalshaStats returns Redis's EVALSHA calls and their total time (µs) so
// far (INFO commandstats).
func evalshaStats(b *testing.B, bd *bundle) (calls, usec int64) {
	info, err := bd.rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(rest, ",") {
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

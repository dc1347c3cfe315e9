package gateway

import (
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/internal/rawhttp"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// wireTurnRequests is the number of requests of one variant per turn of
// BenchmarkSlicedKeyWire.
const wireTurnRequests = 2000

// BenchmarkSlicedKeyWire is BenchmarkSlicedKey over loopback connections:
// 64 clients on keep-alive connections to the handler's server, so that
// the answer's headers cost what they cost on both sides of a connection,
// as in make bench-limits, while the upstream stays in memory. Six
// variants take turns of wireTurnRequests requests, b.N turns each, in an
// order that rotates (a turn ends when its requests are answered):
//
//   - off: the key without limits;
//   - headers: another key without limits (of the same org, team and
//     user), its answers carrying the six x-ratelimit-* fields of a
//     limited answer (setRateHeaders, values as long as the limited
//     key's): what the fields SPEC §8.5 requires cost, apart from the
//     limiter's work;
//   - sliced: the key limited by every kind at key, team and org level,
//     admitted from quota slices;
//
// each with net/http's client and with a wrk-like one (internal/rawhttp,
// the raw- variants: pre-built requests, answers read without a header
// map), whose own cost does not grow with the answer's header fields.
//
// It reports each variant's CPU, allocations and bytes per request and
// the cores the process kept busy, and the medians over the rounds of
// headers/off and sliced/off throughput, each against the same client's
// off (issue 15: sliced ≥ 0.95× off).
func BenchmarkSlicedKeyWire(b *testing.B) {
	e, _, on, off := newSlicedBench(b)
	ctl := e.key("kctl", func(k *configv1.Key) { k.OrgId, k.TeamId, k.UserId = "o2", "t2", "u2" })
	e.apply()
	ctlAuth := "Bearer " + ctl
	inner := e.srv.Config.Handler
	rh := limits.RateHeaders{LimitRequests: 1e10, RemainingRequests: 1e10 - 10, ResetRequests: time.Millisecond,
		LimitTokens: 1e12, RemainingTokens: 1e12 - 1e4, ResetTokens: time.Millisecond}
	e.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == ctlAuth {
			setRateHeaders(w.Header(), rh, false)
		}
		inner.ServeHTTP(w, r)
	})
	tr := &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64}
	b.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	var failed atomic.Value
	type variant struct {
		name, tok string
		raw       bool // the lean client (rawhttp), one connection per worker
		req       []byte
	}
	host := strings.TrimPrefix(e.srv.URL, "http://")
	var vars []variant
	for _, raw := range []bool{false, true} {
		for _, x := range []struct{ name, tok string }{{"off", off}, {"headers", ctl}, {"sliced", on}} {
			v := variant{name: x.name, tok: x.tok, raw: raw}
			if raw {
				v.name = "raw-" + v.name
				v.req = rawhttp.Request(http.MethodPost, host, "/v1/chat/completions",
					[][2]string{{"Content-Type", "application/json"}, {"Authorization", "Bearer " + x.tok}}, []byte(benchSliceBody))
			}
			vars = append(vars, v)
		}
	}
	const workers = 64
	conns := make([]*rawhttp.Conn, workers)
	for i := range conns {
		c, err := rawhttp.Dial(host)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = c.Close() })
		conns[i] = c
	}
	chatRaw := func(v variant, c *rawhttp.Conn) {
		st, body, err := c.Do(v.req)
		if err != nil {
			failed.Store(err)
			return
		}
		if st != http.StatusOK {
			failed.Store(fmt.Sprintf("%s: status %d: %s", v.name, st, body))
		} else if got := c.Header("X-Ratelimit-Limit-Requests") != nil; got != (v.tok != off) {
			failed.Store("x-ratelimit-limit-requests present: " + v.name)
		}
	}
	chat := func(v variant, w int) {
		if v.raw {
			chatRaw(v, conns[w])
			return
		}
		req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/chat/completions", strings.NewReader(benchSliceBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+v.tok)
		resp, err := c.Do(req)
		if err != nil {
			failed.Store(err)
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			failed.Store(resp.Status)
		} else if got := resp.Header.Get("X-Ratelimit-Limit-Requests") != ""; got != (v.tok != off) {
			failed.Store("x-ratelimit-limit-requests present: " + v.name)
		}
	}
	type cost struct {
		wall, cpu      time.Duration
		mallocs, bytes uint64
	}
	// turn runs n requests of v on 64 workers.
	turn := func(v variant, n int) cost {
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		cpu0, t0 := processCPU(), time.Now()
		var next atomic.Int64
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for next.Add(1) <= int64(n) {
					chat(v, w)
				}
			})
		}
		wg.Wait()
		c := cost{wall: time.Since(t0), cpu: processCPU() - cpu0}
		runtime.ReadMemStats(&ms1)
		c.mallocs, c.bytes = ms1.Mallocs-ms0.Mallocs, ms1.TotalAlloc-ms0.TotalAlloc
		return c
	}
	for _, v := range vars {
		turn(v, wireTurnRequests) // connections and warm-up
	}
	sum := make([]cost, len(vars))
	ratios := make([][]float64, len(vars))
	b.ResetTimer()
	for i := range b.N {
		round := make([]cost, len(vars))
		for j := range vars {
			k := (i + j) % len(vars) // each variant goes first in turn
			round[k] = turn(vars[k], wireTurnRequests)
			sum[k].wall += round[k].wall
			sum[k].cpu += round[k].cpu
			sum[k].mallocs += round[k].mallocs
			sum[k].bytes += round[k].bytes
		}
		for k := range vars {
			base := 0 // the same client's key without limits
			if vars[k].raw {
				base = 3
			}
			ratios[k] = append(ratios[k], float64(round[base].wall)/float64(round[k].wall))
		}
		if v := failed.Load(); v != nil {
			b.Fatal(v)
		}
	}
	b.StopTimer()
	n := float64(b.N * wireTurnRequests)
	for k, v := range vars {
		b.ReportMetric(float64(sum[k].cpu.Nanoseconds())/n, v.name+"-cpu-ns/req")
		b.ReportMetric(float64(sum[k].mallocs)/n, v.name+"-allocs/req")
		b.ReportMetric(float64(sum[k].bytes)/n, v.name+"-B/req")
		b.ReportMetric(float64(sum[k].cpu)/float64(sum[k].wall), v.name+"-cores")
		if k%3 > 0 {
			slices.Sort(ratios[k])
			b.ReportMetric(ratios[k][len(ratios[k])/2], v.name+"/"+vars[k-k%3].name+"-throughput")
		}
	}
}

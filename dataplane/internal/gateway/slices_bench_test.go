package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/internal/gctune"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

const (
	benchSliceBody = `{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],` +
		`"max_tokens":128,"temperature":0.7}`
	benchSliceAnswer = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"m",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"A lighthouse keeper guards a remote coast and ` +
		`slowly learns that the light matters less than the people it brings home."},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":42,"completion_tokens":38,"total_tokens":80}}`
)

// memUpstream answers every request with benchSliceAnswer, in memory.
type memUpstream struct{}

func (memUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		_ = r.Body.Close()
	}
	return &http.Response{StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:        http.Header{"Content-Type": {"application/json"}},
		Body:          io.NopCloser(strings.NewReader(benchSliceAnswer)),
		ContentLength: int64(len(benchSliceAnswer)), Request: r}, nil
}

type discardUsage struct{}

func (discardUsage) Record(*usagev1.UsageEvent) {}

// BenchmarkSlicedKey is the data plane's CPU per request (handler,
// limiter and its workers, in process; upstream in memory) for a key
// limited by rpm, tpm, concurrency and a budget at key, team and org level
// and admitted entirely from quota slices, against a key without limits
// on the same handler (issue 15: throughput with limits ≥ 0.95× without).
// cpu-ns/op is the process's CPU per request (ns/op is wall time,
// stretched by other load on a shared machine). The _c64 variants run 64
// requests at a time, as make bench-limits' throughput phase does.
//
// SLUICE_BENCH_GC_HEAP_FLOOR=n (bytes) runs it with `sluice proxy`'s heap
// floor (internal/gctune) of n bytes; unset or 0, with GOGC alone.
func BenchmarkSlicedKey(b *testing.B) {
	if v := os.Getenv("SLUICE_BENCH_GC_HEAP_FLOOR"); v != "" && v != "0" {
		floor, err := strconv.ParseUint(v, 10, 64)
		require.NoError(b, err, "SLUICE_BENCH_GC_HEAP_FLOOR")
		stop, err := gctune.Start(floor)
		require.NoError(b, err)
		defer stop()
	}
	e, lim, on, off := newSlicedBench(b)
	do := func(tok string) *httptest.ResponseRecorder { return serveSliceBench(e, tok) }
	for _, c := range []struct{ name, tok string }{{"off", off}, {"sliced", on}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			calls0 := lim.SliceStats().Calls
			cpu0 := processCPU()
			for b.Loop() {
				if w := do(c.tok); w.Code != http.StatusOK {
					b.Fatal(w.Code, w.Body.String())
				}
			}
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(lim.SliceStats().Calls-calls0)/float64(b.N), "carves/op")
		})
	}
	// 64 requests at a time (make bench-limits' c=64 phase).
	for _, c := range []struct{ name, tok string }{{"off_c64", off}, {"sliced_c64", on}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(32) // × GOMAXPROCS 2
			calls0 := lim.SliceStats().Calls
			cpu0 := processCPU()
			var unavailable atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					w := do(c.tok)
					switch {
					case w.Code == http.StatusServiceUnavailable && strings.Contains(w.Body.String(), openai.CodeLimitsUnavailable):
						// An exact admission (no slice free at that moment)
						// over its call timeout on a loaded machine.
						unavailable.Add(1)
					case w.Code != http.StatusOK:
						b.Error(w.Code, w.Body.String())
						return
					}
				}
			})
			b.ReportMetric(float64(unavailable.Load())/float64(b.N), "503/op")
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(lim.SliceStats().Calls-calls0)/float64(b.N), "carves/op")
		})
	}
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	require.NoError(b, e.h.Drain(cctx))
}

// newSlicedBench is BenchmarkSlicedKey's handler: a key limited by every
// kind at key, team and org level, warmed up until it is admitted from
// slices, and a key without limits (an org, team and user of its own).
func newSlicedBench(b *testing.B) (e *env, lim *limits.Limiter, on, off string) {
	prefix := "pbs" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(b, err)
	b.Cleanup(func() { _ = pipe.Close() })
	lim, err = limits.New(limits.Config{Pipe: pipe, KeyPrefix: prefix, CallTimeout: time.Second,
		Slices: limits.SliceConfig{Enabled: true},
		Seeds: func(_ context.Context, _ string, needs []limits.SeedNeed) ([]int64, error) {
			return make([]int64, len(needs)), nil
		}})
	require.NoError(b, err)
	require.NoError(b, lim.Bootstrap(context.Background(), "o1"))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = lim.RunSlices(ctx) }()
	b.Cleanup(func() { cancel(); wg.Wait() })

	e = newEnv(b, func(c *Config) { c.Limiter, c.Usage, c.Transport = lim, discardUsage{}, memUpstream{} })
	all := func() *configv1.Limits {
		return &configv1.Limits{RpmLimit: ptr[int64](1e10), TpmLimit: ptr[int64](1e12), MaxParallelRequests: ptr[int64](1e5),
			MaxBudget: ptr(1e6), BudgetDuration: "1d"}
	}
	e.snap.Orgs[0].Limits = all()
	e.snap.Teams[0].Limits = all()
	on = e.key("kon", func(k *configv1.Key) { k.Limits = all() })
	// The unlimited key: an org, team and user of its own, without limits.
	e.snap.Orgs = append(e.snap.Orgs, &configv1.Org{Id: "o2"})
	e.snap.Teams = append(e.snap.Teams, &configv1.Team{Id: "t2", OrgId: "o2"})
	e.snap.Users = append(e.snap.Users, &configv1.User{Id: "u2", OrgId: "o2"})
	e.snap.Members = append(e.snap.Members, &configv1.Member{TeamId: "t2", UserId: "u2", OrgId: "o2"})
	off = e.key("koff", func(k *configv1.Key) { k.OrgId, k.TeamId, k.UserId = "o2", "t2", "u2" })
	e.group("m")
	e.deploy("d1", "m", "http://upstream.invalid/v1", nil)
	e.apply()
	do := func(tok string) *httptest.ResponseRecorder { return serveSliceBench(e, tok) }
	for _, tok := range []string{off, on} {
		w := do(tok)
		require.Equal(b, http.StatusOK, w.Code, w.Body.String())
	}
	// Warm up until the limited key is admitted from slices (no Redis
	// call: its settlement is local too): slices of every kind are held,
	// and 200 requests in a row made at most two Redis commands (the
	// slice worker's). A scope's first budget carve may find its window
	// not yet seeded (the first exact admission seeds it); the scope's
	// requests are admitted exactly until the next carve.
	require.Eventually(b, func() bool {
		s := lim.SliceStats()
		c0 := pipe.Stats().Commands
		for range 200 {
			do(on)
		}
		return s.HeldSlots > 0 && s.HeldBudgetMicros > 0 && s.HeldR > 0 && pipe.Stats().Commands-c0 <= 2
	}, 20*time.Second, time.Millisecond)
	return e, lim, on, off
}

// serveSliceBench serves one benchSliceBody request of key tok, in
// process (no connection).
func serveSliceBench(e *env, tok string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(benchSliceBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	w := httptest.NewRecorder()
	e.srv.Config.Handler.ServeHTTP(w, req)
	return w
}

// processCPU is the process's user and system CPU so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

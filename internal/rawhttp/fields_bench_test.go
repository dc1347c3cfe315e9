package rawhttp

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// BenchmarkNetHTTPHeaderFields is what net/http's server costs per
// answer for its header fields, apart from any handler work: handlers
// that set 7 fields (an answer of Sluice without limits: Content-Length,
// Content-Type and five X-Sluice-* fields) and 1, 2, 3 or 6 more (the
// x-ratelimit-* fields of a limited answer), with values built in advance,
// served to this package's client on 64 keep-alive connections. The
// servers take turns of 20,000 requests in an order that rotates;
// <n>fields-cpu-ns/req is the process's CPU per request (server and
// client). docs/limits.md ("A wrk-like load client"): the 9th field takes
// the header map past Go's 8-entry small map.
func BenchmarkNetHTTPHeaderFields(b *testing.B) {
	base := [][2]string{{"Content-Length", "363"}, {"Content-Type", "application/json"}, {"X-Sluice-Attempts", "1"},
		{"X-Sluice-Class-Reason", "default"}, {"X-Sluice-Model-Group", "m"},
		{"X-Sluice-Request-Id", "req_8a5d5ba2856645a0fcec5dbf"}, {"X-Sluice-Traffic-Class", "interactive"}}
	rate := [][2]string{{"X-Ratelimit-Limit-Requests", "10000000000"}, {"X-Ratelimit-Remaining-Requests", "9999998347"},
		{"X-Ratelimit-Reset-Requests", "1m0.5s"}, {"X-Ratelimit-Limit-Tokens", "1000000000000"},
		{"X-Ratelimit-Remaining-Tokens", "999999867640"}, {"X-Ratelimit-Reset-Tokens", "59.5s"}}
	body := []byte(strings.Repeat("x", 363))
	extras := []int{0, 1, 2, 3, 6}
	type server struct {
		req   []byte
		conns []*Conn
		cpu   time.Duration
	}
	var srvs []*server
	for _, x := range extras {
		fields := append(append([][2]string{}, base...), rate[:x]...)
		vals := make([][]string, len(fields))
		for i, f := range fields {
			vals[i] = []string{f[1]}
		}
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			for i, f := range fields {
				h[f[0]] = vals[i][:1:1]
			}
			_, _ = w.Write(body)
		}))
		b.Cleanup(hs.Close)
		host := strings.TrimPrefix(hs.URL, "http://")
		s := &server{req: Request(http.MethodPost, host, "/v1/chat/completions", [][2]string{{"Authorization", "Bearer x"}}, []byte("{}"))}
		for range 64 {
			c, err := Dial(host)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = c.Close() })
			s.conns = append(s.conns, c)
		}
		srvs = append(srvs, s)
	}
	const turn = 20000
	var failed atomic.Value
	run := func(s *server) time.Duration {
		var next atomic.Int64
		var wg sync.WaitGroup
		c0 := processCPU()
		for _, c := range s.conns {
			wg.Go(func() {
				for next.Add(1) <= turn {
					if st, _, err := c.Do(s.req); err != nil || st != http.StatusOK {
						failed.Store(fmt.Sprint(st, err))
						return
					}
				}
			})
		}
		wg.Wait()
		return processCPU() - c0
	}
	for _, s := range srvs {
		run(s) // warm-up
	}
	b.ResetTimer()
	for i := range b.N {
		for j := range srvs {
			s := srvs[(i+j)%len(srvs)]
			s.cpu += run(s)
		}
		if v := failed.Load(); v != nil {
			b.Fatal(v)
		}
	}
	for k, s := range srvs {
		b.ReportMetric(float64(s.cpu.Nanoseconds())/float64(b.N*turn), fmt.Sprintf("%02dfields-cpu-ns/req", 7+extras[k]))
	}
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// headerMapSink keeps BenchmarkHeaderMap's maps on the heap, as net/http's.
var headerMapSink http.Header

// BenchmarkHeaderMap is the part of BenchmarkNetHTTPHeaderFields that is
// the header map alone, without a server, connection or client: what
// net/http does with an answer's map for n fields (the handler's map,
// created empty and filled; its copy at WriteHeader; its keys collected
// and sorted before they are written). The step from 8 to 9 fields is the
// map outgrowing Go's 8-entry small map: the handler's map grows into a
// table, and the copy is made as one (docs/limits.md, "Headers").
func BenchmarkHeaderMap(b *testing.B) {
	names := []string{"Content-Length", "Content-Type", "X-Sluice-Attempts", "X-Sluice-Class-Reason",
		"X-Sluice-Model-Group", "X-Sluice-Request-Id", "X-Sluice-Traffic-Class",
		"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests",
		"X-Ratelimit-Limit-Tokens", "X-Ratelimit-Remaining-Tokens", "X-Ratelimit-Reset-Tokens"}
	vals := make([][]string, len(names))
	for i, n := range names {
		vals[i] = []string{"value of " + n}
	}
	for _, n := range []int{7, 8, 9, 13} {
		b.Run(fmt.Sprintf("%02dfields", n), func(b *testing.B) {
			b.ReportAllocs()
			keys := make([]string, 0, len(names))
			for b.Loop() {
				h := make(http.Header)
				headerMapSink = h
				for i := range n {
					h[names[i]] = vals[i][:1:1]
				}
				c := h.Clone()
				keys = keys[:0]
				for k := range c {
					keys = append(keys, k)
				}
				slices.SortFunc(keys, strings.Compare)
			}
			if len(keys) != n {
				b.Fatal(len(keys), n)
			}
		})
	}
}

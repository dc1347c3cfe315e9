package upstream

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const vllmPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 2
vllm:num_requests_waiting{engine="0",model_name="m"} 4
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1e+06
`

func TestParseEngineMetrics(t *testing.T) {
	s, ok := ParseEngineMetrics([]byte(vllmPage))
	if !ok || s.Running != 5 || s.Waiting != 4 || s.KVUsage != 0.5 {
		t.Fatalf("got %+v, %v", s, ok)
	}
	for _, page := range []string{"", "# only comments\n", "other_metric 5\n", "vllm:num_requests_running{x=\"1\"} NaN\n",
		"vllm:num_requests_running -3\n", "vllm:num_requests_running{unterminated 3\n"} {
		if s, ok := ParseEngineMetrics([]byte(page)); ok {
			t.Errorf("%q: got %+v, want no sample", page, s)
		}
	}
	// Labels with braces or spaces in their values, timestamps.
	s, ok = ParseEngineMetrics([]byte("vllm:num_requests_waiting{model_name=\"a } b\"} 7 1700000000000\n"))
	if !ok || s.Waiting != 7 {
		t.Fatalf("got %+v, %v", s, ok)
	}
}

func FuzzParseEngineMetrics(f *testing.F) {
	f.Add([]byte(vllmPage))
	f.Add([]byte("vllm:num_requests_running 1\nvllm:num_requests_waiting{a=\"}\"} 2"))
	f.Fuzz(func(t *testing.T, page []byte) {
		s, ok := ParseEngineMetrics(page)
		if !ok && (s.Running != 0 || s.Waiting != 0) {
			t.Fatalf("no sample but values %+v", s)
		}
		if s.Running < 0 || s.Waiting < 0 || s.KVUsage < 0 || s.KVUsage > 1 {
			t.Fatalf("out of range: %+v", s)
		}
	})
}

// A hanging endpoint neither blocks the other engines' polls nor piles up
// polls of its own; its sample ages out while the others stay fresh.
func TestMetricsPollerHangingEndpoint(t *testing.T) {
	var good atomic.Int64
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		good.Add(1)
		_, _ = w.Write([]byte(vllmPage))
	}))
	defer ok.Close()
	var hangCalls atomic.Int64
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hangCalls.Add(1)
		<-r.Context().Done()
	}))
	defer hang.Close()
	// Polls of the hanging engine in flight, counted where the poller
	// makes them (the server sees a poll end only once it notices the
	// connection closed, after the poller may have started the next).
	inHang := &inflightTransport{host: strings.TrimPrefix(hang.URL, "http://"), t: t}
	var st States
	p := &MetricsPoller{Targets: func() []MetricsTarget {
		return []MetricsTarget{{ID: "ok", APIBase: ok.URL + "/v1"}, {ID: "hang", APIBase: hang.URL + "/v1"}}
	}, States: &st, Client: &http.Client{Transport: inHang}, Interval: 20 * time.Millisecond}
	st.Get("hang").Engine.Store(EngineSample{Running: 1, At: time.Now()})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for good.Load() < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("the good engine was polled %d times", good.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if s, fresh := st.Get("ok").Engine.Fresh(time.Now(), time.Second); !fresh || s.Running != 5 {
		t.Fatalf("good engine: %+v, %v", s, fresh)
	}
	for {
		if _, fresh := st.Get("hang").Engine.Fresh(time.Now(), 100*time.Millisecond); !fresh {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the hanging engine's sample never aged out")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if hangCalls.Load() == 0 {
		t.Fatal("the hanging engine was never polled")
	}
}

// inflightTransport counts the requests to host in flight (from the
// round trip's start until it fails or its body is closed) and fails the
// test if two overlap.
type inflightTransport struct {
	host string
	t    *testing.T
	n    atomic.Int64
}

func (it *inflightTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Host != it.host {
		return http.DefaultTransport.RoundTrip(r)
	}
	if it.n.Add(1) > 1 {
		it.t.Error("two polls of one engine at once")
	}
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		it.n.Add(-1)
		return nil, err
	}
	resp.Body = &countedBody{ReadCloser: resp.Body, n: &it.n}
	return resp, nil
}

// countedBody ends its request's count when closed (once).
type countedBody struct {
	io.ReadCloser
	n    *atomic.Int64
	once sync.Once
}

func (b *countedBody) Close() error {
	b.once.Do(func() { b.n.Add(-1) })
	return b.ReadCloser.Close()
}

func TestMetricsURL(t *testing.T) {
	for in, want := range map[string]string{"http://e:8000/v1": "http://e:8000/metrics", "http://e:8000/v1/": "http://e:8000/metrics", "http://e/x": "http://e/x/metrics"} {
		if got := MetricsURL(in); got != want {
			t.Errorf("%s: %s, want %s", in, got, want)
		}
	}
}

// A page that never changes keeps the time it first arrived: a frozen
// exporter's values age out although every poll succeeds.
func TestMetricsPollerFrozenPage(t *testing.T) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		_, _ = w.Write([]byte(vllmPage))
	}))
	defer srv.Close()
	var st States
	p := &MetricsPoller{Targets: func() []MetricsTarget { return []MetricsTarget{{ID: "e", APIBase: srv.URL + "/v1"}} },
		States: &st, Client: http.DefaultClient, Interval: 10 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); t.Logf("poller stopped: %v", <-done) }()
	deadline := time.Now().Add(10 * time.Second)
	for n.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("never polled")
		}
		time.Sleep(time.Millisecond)
	}
	if _, fresh := st.Get("e").Engine.Fresh(time.Now(), time.Hour); !fresh {
		t.Fatal("no sample")
	}
	for {
		if _, fresh := st.Get("e").Engine.Fresh(time.Now(), 50*time.Millisecond); !fresh {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("an unchanged page stayed fresh over %d polls", n.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// gogcMetric reads go_gc_gogc_percent from a /metrics answer.
func gogcMetric(url string) (float64, bool) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_gc_gogc_percent "); ok {
			f, err := strconv.ParseFloat(v, 64)
			return f, err == nil
		}
	}
	return 0, false
}

// TestProxyGCHeapFloor runs `sluice proxy` (real NATS and Redis) with a
// heap floor far above this process's live heap: after a collection, the
// proxy's /metrics shows GOGC raised; once the proxy stops, GOGC is what it
// was. A negative floor is refused at start. Not parallel: GOGC is the
// process's, and the other tests here run proxies of their own.
func TestProxyGCHeapFloor(t *testing.T) {
	getenv := func(string) string { return "" }
	err := run(context.Background(), []string{"proxy", "--gc-heap-floor", "-1"}, getenv, io.Discard, io.Discard)
	require.ErrorContains(t, err, "--gc-heap-floor -1")

	base := debug.SetGCPercent(100)
	debug.SetGCPercent(base)
	nats := testsvc.StartNATS(t)
	env := map[string]string{"SLUICE_KEY_PEPPER": "1:gc-test-pepper-0123456789abcdef0123456789"}
	addr := freeLoopbackAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"proxy", "--addr", addr, "--nats-url", nats.URL, "--gc-heap-floor", strconv.Itoa(1 << 30),
			"--redis-key-prefix", fmt.Sprintf("gc-test-%d:", time.Now().UnixNano()), "--log-level", "error"},
			func(k string) string { return env[k] }, io.Discard, io.Discard)
	}()
	var gogc float64
	testsvc.Eventually(t, func() bool {
		select {
		case err := <-done:
			t.Fatalf("sluice proxy stopped: %v", err)
		default:
		}
		runtime.GC()
		v, ok := gogcMetric("http://" + addr + "/metrics")
		gogc = v
		return ok && v > float64(base)
	}, 30*time.Second, 20*time.Millisecond, "go_gc_gogc_percent above %d on the proxy's /metrics", base)
	t.Logf("GOGC %g with a 1 GiB heap floor (base %d)", gogc, base)
	cancel()
	select {
	case err := <-done:
		t.Logf("sluice proxy stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("sluice proxy did not stop")
	}
	now := debug.SetGCPercent(100)
	debug.SetGCPercent(now)
	require.Equal(t, base, now, "GOGC restored when the proxy stops")
}

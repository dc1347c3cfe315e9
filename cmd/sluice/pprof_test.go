package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

func TestPprofOffByDefault(t *testing.T) {
	t.Parallel()
	for _, sub := range []string{"control", "proxy"} {
		var found bool
		for _, f := range helpFlags(t, sub) {
			if f.name == "pprof-addr" {
				found = true
				require.Empty(t, f.def, "sluice %s: --pprof-addr must default to off", sub)
			}
		}
		require.True(t, found, "sluice %s has --pprof-addr", sub)
	}
}

func TestPprofRefusesNonLoopbackAddresses(t *testing.T) {
	t.Parallel()
	getenv := func(string) string { return "" }
	for _, sub := range []string{"control", "proxy"} {
		for _, addr := range []string{"0.0.0.0:6060", ":6060", "10.1.2.3:6060", "example.com:6060", "127.0.0.1"} {
			err := run(context.Background(), []string{sub, "--pprof-addr", addr}, getenv, io.Discard, io.Discard)
			require.Error(t, err, "sluice %s --pprof-addr %s", sub, addr)
			require.Contains(t, err.Error(), "--pprof-addr", "sluice %s --pprof-addr %s", sub, addr)
		}
		// The environment variable is checked the same way.
		env := func(k string) string {
			if k == "SLUICE_PPROF_ADDR" {
				return "0.0.0.0:6060"
			}
			return ""
		}
		err := run(context.Background(), []string{sub}, env, io.Discard, io.Discard)
		require.ErrorContains(t, err, "loopback only")
	}
	// Labels show only in profiles, so they need the profiler.
	err := run(context.Background(), []string{"proxy", "--pprof-labels"}, getenv, io.Discard, io.Discard)
	require.ErrorContains(t, err, "--pprof-labels")
	for _, addr := range []string{"", "127.0.0.1:6060", "[::1]:6060", "localhost:6060", "127.0.0.2:0"} {
		require.NoError(t, checkPprofAddr(addr), addr)
	}
}

// freeLoopbackAddr returns a loopback address whose port was free a
// moment ago, for a process under test to listen on.
//
// The port is taken below the kernel's ephemeral range when it can be:
// a port of that range, free when it is picked, can be given to another
// test's outgoing connection before the process under test binds it (CI
// saw "address already in use" once). Below the range only another
// listener picking the same port at random can take it.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	if low > 11000 {
		for range 50 {
			ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(10000+rand.IntN(low-10000)))
			if err == nil {
				addr := ln.Addr().String()
				_ = ln.Close()
				return addr
			}
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }()
	return ln.Addr().String()
}

// pprofServes reports whether addr answers /debug/pprof/ with the
// profiler's index.
func pprofServes(addr string) bool {
	resp, err := http.Get("http://" + addr + "/debug/pprof/")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode == http.StatusOK && strings.Contains(string(b), "goroutine")
}

// TestPprofServesOnBothPlanes runs `sluice control` and `sluice proxy`
// (real Postgres, NATS and Redis) with --pprof-addr and fetches the
// profiler's index and a goroutine profile from each, then checks that
// the listener goes away with the process's context.
func TestPprofServesOnBothPlanes(t *testing.T) {
	t.Parallel()
	nats := testsvc.StartNATS(t)
	db := testsvc.NewDatabase(t)
	env := map[string]string{
		"SLUICE_ADMIN_TOKEN": "sk-admin-pprof-test-0123456789abcdef0123456789",
		"SLUICE_KEY_PEPPER":  "1:pprof-test-pepper-0123456789abcdef",
		"SLUICE_KEK":         "1:" + base64.StdEncoding.EncodeToString(make([]byte, 32)),
	}
	getenv := func(k string) string { return env[k] }
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	start := func(args ...string) (string, <-chan error) {
		addr := freeLoopbackAddr(t)
		done := make(chan error, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := run(ctx, append(args, "--pprof-addr", addr), getenv, io.Discard, io.Discard)
			if ctx.Err() == nil {
				t.Errorf("sluice %s stopped: %v", args[0], err)
			}
			done <- err
		}()
		return addr, done
	}
	cpAddr, cpDone := start("control", "--addr", freeLoopbackAddr(t), "--database-url", db, "--nats-url", nats.URL,
		"--migrate", "--log-level", "error")
	dpAddr, dpDone := start("proxy", "--addr", freeLoopbackAddr(t), "--nats-url", nats.URL,
		"--redis-key-prefix", fmt.Sprintf("pprof-test-%d:", time.Now().UnixNano()), "--log-level", "error")
	for name, addr := range map[string]string{"control": cpAddr, "proxy": dpAddr} {
		testsvc.Eventually(t, func() bool { return pprofServes(addr) }, 30*time.Second, 50*time.Millisecond,
			"sluice %s does not serve /debug/pprof/ on %s", name, addr)
		resp, err := http.Get("http://" + addr + "/debug/pprof/goroutine?debug=1")
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Contains(t, string(b), "goroutine profile", name)
	}
	cancel()
	for name, done := range map[string]<-chan error{"control": cpDone, "proxy": dpDone} {
		select {
		case err := <-done:
			t.Logf("sluice %s stopped: %v", name, err)
		case <-time.After(30 * time.Second):
			t.Fatalf("sluice %s did not stop", name)
		}
	}
	for name, addr := range map[string]string{"control": cpAddr, "proxy": dpAddr} {
		require.False(t, pprofServes(addr), "sluice %s still serves pprof after it stopped", name)
	}
}

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"
)

// pprofFlag registers --pprof-addr, shared by `sluice control` and `sluice
// proxy`: off (empty) by default.
func pprofFlag(fs *flag.FlagSet) *string {
	return fs.String("pprof-addr", "",
		"serve Go's profiler (/debug/pprof/) on this loopback address, e.g. 127.0.0.1:6060 (default: off; other addresses are refused)")
}

// checkPprofAddr accepts an empty address (off) and loopback ones only:
// the profiler shows goroutine stacks and heap contents, and profiling
// costs CPU, so it never listens where another machine can reach it. To
// profile a pod, port-forward to it.
func checkPprofAddr(addr string) error {
	if addr == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil || port == "" {
		return fmt.Errorf("--pprof-addr %q: want host:port, e.g. 127.0.0.1:6060", addr)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("--pprof-addr %q: the profiler listens on loopback only (127.0.0.1, ::1 or localhost); "+
		"reach it from elsewhere through a port forward or an SSH tunnel", addr)
}

// startPprof serves the profiler on addr until ctx is done; an empty addr
// serves nothing. It returns once the listener is open (so a busy port is
// an error at start) and a function that waits for the server to stop.
func startPprof(ctx context.Context, addr string, log *slog.Logger) (wait func(), err error) {
	if err := checkPprofAddr(addr); err != nil {
		return nil, err
	}
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("pprof listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("pprof server stopped", "error", err)
		}
	}()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	log.Info("pprof serving", "addr", ln.Addr().String())
	return func() { <-done }, nil
}

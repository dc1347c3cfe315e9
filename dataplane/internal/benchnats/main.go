// Command benchnats runs a NATS server with JetStream (the nats-server
// version this module requires, embedded) as its own process, for
// benchmarks that must not share their process with infrastructure that
// runs elsewhere in production (dataplane/proxy_bench_test.go builds and
// starts it). It is a test helper: no production binary includes it.
//
//	benchnats -port 4222 -store /tmp/js [-sync-always] [-pprof-addr 127.0.0.1:6062]
//
// It prints "ready" on stdout once it accepts connections and stops on
// SIGINT/SIGTERM or when its standard input closes (so it never outlives
// the benchmark that started it).
package main

import (
	"flag"
	"fmt"
	"io"
	"net/http"
	_ "net/http/pprof" // -pprof-addr
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

func main() {
	port := flag.Int("port", 4222, "client port on 127.0.0.1")
	store := flag.String("store", "", "JetStream store directory (required)")
	pprofAddr := flag.String("pprof-addr", "", "serve Go's profiler (/debug/pprof/) on this loopback address (default: off)")
	syncAlways := flag.Bool("sync-always", false, "fsync the JetStream store after every write (as the test NATS does)")
	flag.Parse()
	if *store == "" {
		fmt.Fprintln(os.Stderr, "benchnats: -store is required")
		os.Exit(2)
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: *port, JetStream: true, StoreDir: *store,
		NoLog: true, NoSigs: true, SyncAlways: *syncAlways})
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchnats:", err)
		os.Exit(1)
	}
	if *pprofAddr != "" {
		go func() { fmt.Fprintln(os.Stderr, "benchnats: pprof:", http.ListenAndServe(*pprofAddr, nil)) }()
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		fmt.Fprintln(os.Stderr, "benchnats: not ready within 10s")
		os.Exit(1)
	}
	fmt.Println("ready")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); stop <- syscall.SIGTERM }()
	<-stop
	srv.Shutdown()
	srv.WaitForShutdown()
}

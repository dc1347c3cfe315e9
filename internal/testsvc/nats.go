package testsvc

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATSServer is an embedded, current nats-server with JetStream on a
// random loopback port, its store in a test temp dir. Stop and Start keep
// the port and the store, so tests can take NATS away and bring it back.
type NATSServer struct {
	t    testing.TB
	opts *server.Options
	srv  *server.Server
	// URL is the client URL (stable across Stop/Start).
	URL string
}

// StartNATS starts an embedded NATS server with JetStream (sync always,
// like a production deployment where durability matters) and stops it at
// cleanup.
func StartNATS(t testing.TB) *NATSServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("pick a port: %v", err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	n := &NATSServer{t: t, opts: &server.Options{
		Host:       "127.0.0.1",
		Port:       port,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		NoLog:      true,
		NoSigs:     true,
		SyncAlways: true,
	}, URL: fmt.Sprintf("nats://127.0.0.1:%d", port)}
	n.Start()
	t.Cleanup(n.Stop)
	return n
}

// Start (re)starts the server.
func (n *NATSServer) Start() {
	n.t.Helper()
	if n.srv != nil && n.srv.Running() {
		return
	}
	var srv *server.Server
	var err error
	for attempt := 0; attempt < 50; attempt++ { // the port may linger briefly after Stop
		if srv, err = server.NewServer(n.opts); err != nil {
			n.t.Fatalf("nats server: %v", err)
		}
		go srv.Start()
		if srv.ReadyForConnections(5 * time.Second) {
			n.srv = srv
			return
		}
		srv.Shutdown()
		time.Sleep(100 * time.Millisecond)
	}
	n.t.Fatalf("nats server did not start on %s", n.URL)
}

// Stop shuts the server down (idempotent).
func (n *NATSServer) Stop() {
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv.WaitForShutdown()
		n.srv = nil
	}
}

// Wipe deletes the server's JetStream store; call it while stopped to
// simulate a NATS server that lost its data (or a brand-new one).
func (n *NATSServer) Wipe() {
	n.t.Helper()
	if n.srv != nil {
		n.t.Fatal("Wipe needs a stopped server")
	}
	entries, err := os.ReadDir(n.opts.StoreDir)
	if err != nil {
		n.t.Fatalf("wipe nats store: %v", err)
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(n.opts.StoreDir, e.Name())); err != nil {
			n.t.Fatalf("wipe nats store: %v", err)
		}
	}
}

// Backup copies the server's JetStream store (call it while stopped) into
// a new directory and returns it: a backup of NATS taken at this moment.
func (n *NATSServer) Backup() string {
	n.t.Helper()
	if n.srv != nil {
		n.t.Fatal("Backup needs a stopped server")
	}
	dst := n.t.TempDir()
	if err := os.CopyFS(dst, os.DirFS(n.opts.StoreDir)); err != nil {
		n.t.Fatalf("back up nats store: %v", err)
	}
	return dst
}

// RestoreBackup replaces the server's JetStream store (call it while
// stopped) with a copy of dir, taken earlier with Backup.
func (n *NATSServer) RestoreBackup(dir string) {
	n.t.Helper()
	n.Wipe()
	if err := os.CopyFS(n.opts.StoreDir, os.DirFS(dir)); err != nil {
		n.t.Fatalf("restore nats store: %v", err)
	}
}

package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// docFlag is one flag as `sluice <sub> -h` prints it.
type docFlag struct {
	name string
	def  string // "" for the zero value (PrintDefaults omits it)
	envs []string
}

var (
	helpFlagRE    = regexp.MustCompile(`^  -([a-z0-9-]+)`)
	helpDefaultRE = regexp.MustCompile(`\(default "?(.*?)"?\)$`)
	helpEnvRE     = regexp.MustCompile(`\((SLUICE_[A-Z0-9_]+)(?:, or (SLUICE_[A-Z0-9_]+))?\)`)
)

// helpFlags runs `sluice <sub> -h` and returns its flags.
func helpFlags(t *testing.T, sub string) []docFlag {
	t.Helper()
	var stderr bytes.Buffer
	getenv := func(string) string { return "" }
	if err := run(context.Background(), []string{sub, "-h"}, getenv, io.Discard, &stderr); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("sluice %s -h: %v", sub, err)
	}
	var out []docFlag
	for line := range strings.SplitSeq(stderr.String(), "\n") {
		if m := helpFlagRE.FindStringSubmatch(line); m != nil {
			out = append(out, docFlag{name: m[1]})
			continue
		}
		if len(out) == 0 || !strings.HasPrefix(line, "    \t") {
			continue
		}
		f := &out[len(out)-1]
		if m := helpEnvRE.FindStringSubmatch(line); m != nil {
			f.envs = slices.DeleteFunc([]string{m[1], m[2]}, func(s string) bool { return s == "" })
		}
		if m := helpDefaultRE.FindStringSubmatch(line); m != nil {
			f.def = m[1]
		}
	}
	return out
}

// docRow is one flag row of a README configuration table.
type docRow struct {
	envs []string
	def  string // the default cell's leading `value`, "" when it has none
}

var backticked = regexp.MustCompile("`([^`]*)`")

// readmeFlags returns the rows of the table under README's
// "### Configuration (`sluice <sub>`)" heading, by flag name.
func readmeFlags(t *testing.T, sub string) map[string]docRow {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	heading := "### Configuration (`sluice " + sub + "`)"
	_, rest, ok := strings.Cut(string(b), heading+"\n")
	if !ok {
		t.Fatalf("README has no %q section", heading)
	}
	rows := map[string]docRow{}
	inTable := false
	for line := range strings.SplitSeq(rest, "\n") {
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) < 4 {
			t.Fatalf("README %s: row %q has %d cells, want 4", sub, line, len(cells))
		}
		name, ok := strings.CutPrefix(strings.TrimSpace(cells[0]), "`--")
		if !ok {
			continue // header, separator or a secret read from the environment only
		}
		name = strings.TrimSuffix(name, "`")
		if _, dup := rows[name]; dup {
			t.Errorf("README %s: --%s has two rows", sub, name)
		}
		var r docRow
		for _, m := range backticked.FindAllStringSubmatch(cells[1], -1) {
			r.envs = append(r.envs, m[1])
		}
		if d := strings.TrimSpace(cells[2]); strings.HasPrefix(d, "`") {
			r.def = backticked.FindStringSubmatch(d)[1]
		}
		rows[name] = r
	}
	if len(rows) == 0 {
		t.Fatalf("README %s: no flag rows under %q", sub, heading)
	}
	return rows
}

// sameDefault compares a flag's printed default with the README's,
// durations by value (`60s` documents 1m0s).
func sameDefault(flagDef, docDef string) bool {
	if flagDef == docDef {
		return true
	}
	a, errA := time.ParseDuration(flagDef)
	b, errB := time.ParseDuration(docDef)
	return errA == nil && errB == nil && a == b
}

// TestReadmeFlagTables checks README's configuration table of every
// command against its flag set: each flag has exactly one row, no row
// names a flag the command lacks, and each row's variables and default
// are the flag's.
func TestReadmeFlagTables(t *testing.T) {
	for _, sub := range []string{"control", "proxy", "dev", "migrate"} {
		t.Run(sub, func(t *testing.T) {
			flags := helpFlags(t, sub)
			rows := readmeFlags(t, sub)
			for _, f := range flags {
				r, ok := rows[f.name]
				if !ok {
					t.Errorf("--%s is missing from README's `sluice %s` table", f.name, sub)
					continue
				}
				delete(rows, f.name)
				if len(f.envs) == 0 || f.envs[0] != envName(f.name) {
					t.Errorf("--%s: help names variables %v, want %s first", f.name, f.envs, envName(f.name))
				}
				if !slices.Equal(r.envs, f.envs) {
					t.Errorf("--%s: README names variables %v, the command reads %v", f.name, r.envs, f.envs)
				}
				if !sameDefault(f.def, r.def) {
					t.Errorf("--%s: README default %q, the flag's is %q", f.name, r.def, f.def)
				}
			}
			for name := range rows {
				t.Errorf("README's `sluice %s` table has --%s, which the command does not have", sub, name)
			}
		})
	}
}

// TestEnvFallback checks the environment layer: SLUICE_<FLAG> sets a
// flag, an alias sets it when the main name is unset, the command line
// wins over both, and bad values are all reported, naming the variable.
func TestEnvFallback(t *testing.T) {
	newFS := func() (*flag.FlagSet, *string, *time.Duration, *bool) {
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		addr := fs.String("addr", "default", "")
		d := fs.Duration("read-timeout", time.Second, "")
		b := fs.Bool("migrate", false, "")
		return fs, addr, d, b
	}
	aliases := envAliases{"addr": "SLUICE_OLD_ADDR"}
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

	fs, addr, d, b := newFS()
	if err := parseEnvFlags(fs, nil, env(map[string]string{"SLUICE_ADDR": "a", "SLUICE_OLD_ADDR": "old", "SLUICE_READ_TIMEOUT": "5s", "SLUICE_MIGRATE": "true"}), aliases); err != nil {
		t.Fatal(err)
	}
	if *addr != "a" || *d != 5*time.Second || !*b {
		t.Errorf("from env: addr=%q read-timeout=%v migrate=%v", *addr, *d, *b)
	}
	fs, addr, _, _ = newFS()
	if err := parseEnvFlags(fs, nil, env(map[string]string{"SLUICE_OLD_ADDR": "old"}), aliases); err != nil {
		t.Fatal(err)
	}
	if *addr != "old" {
		t.Errorf("alias: addr=%q, want old", *addr)
	}
	fs, addr, _, _ = newFS()
	if err := parseEnvFlags(fs, []string{"--addr=flag"}, env(map[string]string{"SLUICE_ADDR": "a"}), aliases); err != nil {
		t.Fatal(err)
	}
	if *addr != "flag" {
		t.Errorf("command line: addr=%q, want flag", *addr)
	}
	fs, _, _, _ = newFS()
	err := parseEnvFlags(fs, nil, env(map[string]string{"SLUICE_READ_TIMEOUT": "soon", "SLUICE_MIGRATE": "maybe"}), aliases)
	if err == nil || !strings.Contains(err.Error(), `SLUICE_READ_TIMEOUT="soon"`) || !strings.Contains(err.Error(), `SLUICE_MIGRATE="maybe"`) {
		t.Errorf("bad values: %v, want both variables named", err)
	}
}

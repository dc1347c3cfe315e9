package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
)

// app holds what every command needs: the environment, the output streams
// and the global flags.
type app struct {
	getenv      func(string) string
	stdout      io.Writer
	stderr      io.Writer
	output      string // -o: table, json or yaml
	contextName string // --context

	warnOnce sync.Once
}

// command is a node of the command tree: a group with subcommands or a
// leaf with run.
type command struct {
	name    string
	aliases []string
	args    string // positional arguments, for usage
	summary string
	subs    []*command
	run     func(ctx context.Context, a *app, c *cmdArgs) error
}

// cmdArgs is a leaf command's invocation: its path, its arguments and its
// flag set (built by the leaf).
type cmdArgs struct {
	path string // "key update"
	cmd  *command
	args []string
}

const toolUsage = `sluicectl manages a Sluice control plane through its admin API.

usage: sluicectl [-o table|json|yaml] [--context NAME] <command> [arguments] [flags]

Global flags (before or after the command):
  -o, --output FORMAT   table (default), json or yaml
  --context NAME        use this context instead of the current one

Environment: SLUICE_SERVER and SLUICE_TOKEN override the context's server
and token; SLUICE_CONTEXT picks a context; SLUICE_CONFIG names the config
file (default $XDG_CONFIG_HOME/sluice/config.yaml or ~/.config/sluice/config.yaml).
`

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	a := &app{getenv: getenv, stdout: stdout, stderr: stderr, output: outTable, contextName: getenv("SLUICE_CONTEXT")}
	top := flag.NewFlagSet("sluicectl", flag.ContinueOnError)
	top.SetOutput(io.Discard)
	a.globalFlags(top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printGroup(stdout, "", rootCommand())
			return nil
		}
		return fmt.Errorf("%w (see 'sluicectl help')", err)
	}
	return dispatch(ctx, a, rootCommand(), "", top.Args())
}

// globalFlags registers -o/--output and --context on fs, keeping values
// already parsed.
func (a *app) globalFlags(fs *flag.FlagSet) {
	fs.StringVar(&a.output, "o", a.output, "output format: table, json or yaml")
	fs.StringVar(&a.output, "output", a.output, "output format: table, json or yaml")
	fs.StringVar(&a.contextName, "context", a.contextName, "context to use (default: the current context)")
}

func rootCommand() *command {
	return &command{subs: []*command{
		loginCommand(), contextCommand(), whoamiCommand(),
		orgCommand(), teamCommand(), memberCommand(), userCommand(), keyCommand(),
		customerCommand(), projectCommand(), tagCommand(), issuerCommand(), tokenCommand(), auditCommand(),
		fleetCommand(), rolloutCommand(), regionCommand(), spendCommand(), alertsCommand(),
		modelGroupCommand(), deploymentCommand(), trafficCommand(), applyCommand(), getCommand(), importCommand(), explainCommand(),
	}}
}

func (c *command) find(name string) *command {
	for _, s := range c.subs {
		if s.name == name || slices.Contains(s.aliases, name) {
			return s
		}
	}
	return nil
}

// dispatch walks the command tree along args and runs the leaf.
func dispatch(ctx context.Context, a *app, c *command, path string, args []string) error {
	if c.run != nil {
		return c.run(ctx, a, &cmdArgs{path: path, cmd: c, args: args})
	}
	if len(args) == 0 {
		printGroup(a.stderr, path, c)
		if path == "" {
			return errors.New("no command given")
		}
		return fmt.Errorf("%s: no subcommand given", path)
	}
	name := args[0]
	if name == "help" || name == "-h" || name == "--help" || name == "-help" {
		if len(args) > 1 { // "help key create"
			return dispatch(ctx, a, c, path, append(args[1:], "-h"))
		}
		printGroup(a.stdout, path, c)
		return nil
	}
	sub := c.find(name)
	if sub == nil {
		what := "command"
		if path != "" {
			what = path + " subcommand"
		}
		return fmt.Errorf("unknown %s %q (see 'sluicectl %s help')", what, name, strings.TrimSpace(path))
	}
	return dispatch(ctx, a, sub, strings.TrimSpace(path+" "+sub.name), args[1:])
}

func printGroup(w io.Writer, path string, c *command) {
	if path == "" {
		fmt.Fprint(w, toolUsage)
		fmt.Fprintln(w, "\nCommands:")
	} else {
		fmt.Fprintf(w, "usage: sluicectl %s <subcommand> [arguments] [flags]\n\nSubcommands:\n", path)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	for _, s := range c.subs {
		name := s.name
		if s.args != "" && path != "" {
			name += " " + s.args
		}
		fmt.Fprintf(tw, "  %s\t%s\n", name, s.summary)
	}
	tw.Flush()
	fmt.Fprintf(w, "\nRun 'sluicectl %s<subcommand> -h' for its flags.\n", pathPrefix(path))
}

// flags returns the leaf's flag set with the global flags on it.
func (a *app) flags(c *cmdArgs) *flag.FlagSet {
	fs := flag.NewFlagSet("sluicectl "+c.path, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	a.globalFlags(fs)
	return fs
}

// parse parses c.args with fs, allowing flags before, between and after
// positional arguments ("key update ID --rpm-limit 10"); "--" ends flags.
// It checks that between minArgs and maxArgs positional arguments were
// given (maxArgs < 0: any number) and the output format. On -h it prints
// usage and returns flag.ErrHelp.
func (a *app) parse(fs *flag.FlagSet, c *cmdArgs, minArgs, maxArgs int) ([]string, error) {
	var pos []string
	rest := c.args
	for {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				a.usage(fs, c)
				return nil, flag.ErrHelp
			}
			return nil, fmt.Errorf("%s: %w (see 'sluicectl %s -h')", c.path, err, c.path)
		}
		consumed := len(rest) - fs.NArg()
		if consumed > 0 && rest[consumed-1] == "--" {
			pos = append(pos, fs.Args()...)
			break
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	if err := validOutput(a.output); err != nil {
		return nil, err
	}
	switch {
	case len(pos) < minArgs:
		return nil, fmt.Errorf("%s: missing argument: usage: sluicectl %s %s", c.path, c.path, c.cmd.args)
	case maxArgs >= 0 && len(pos) > maxArgs:
		return nil, fmt.Errorf("%s: unexpected argument %q: usage: sluicectl %s %s", c.path, pos[maxArgs], c.path, c.cmd.args)
	}
	return pos, nil
}

func pathPrefix(path string) string {
	if path == "" {
		return ""
	}
	return path + " "
}

// usage prints a leaf's usage and flags (the global flags in one line).
func (a *app) usage(fs *flag.FlagSet, c *cmdArgs) {
	fmt.Fprintf(a.stdout, "usage: sluicectl %s%s[flags]\n\n%s.\n", pathPrefix(c.path), pathPrefix(c.cmd.args), c.cmd.summary)
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 3, ' ', 0)
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == "o" || f.Name == "output" || f.Name == "context" {
			return
		}
		if n == 0 {
			fmt.Fprintln(tw, "\nFlags:")
		}
		n++
		name, text := flag.UnquoteUsage(f)
		if ph, ok := f.Value.(interface{ placeholder() string }); ok && name == "value" {
			name = ph.placeholder()
		}
		if name == "string" {
			name = "TEXT"
			if f.Name == "org" || f.Name == "team" || f.Name == "user" || f.Name == "object-id" {
				name = "ID"
			}
		}
		if name != "" {
			name = " " + name
		}
		fmt.Fprintf(tw, "  --%s%s\t%s\n", f.Name, name, text)
	})
	tw.Flush()
	fmt.Fprintln(a.stdout, "\nGlobal flags: -o table|json|yaml, --context NAME")
}

// leaf builds a leaf command whose body turns flag.ErrHelp into success.
func leaf(name, args, summary string, run func(ctx context.Context, a *app, c *cmdArgs) error, aliases ...string) *command {
	return &command{name: name, args: args, summary: summary, aliases: aliases,
		run: func(ctx context.Context, a *app, c *cmdArgs) error {
			err := run(ctx, a, c)
			if errors.Is(err, flag.ErrHelp) {
				return nil
			}
			return err
		}}
}

// group builds a command with subcommands.
func group(name, summary string, subs []*command, aliases ...string) *command {
	return &command{name: name, summary: summary, subs: subs, aliases: aliases}
}

// connect resolves the server and token and returns the clients and the
// printer for the chosen output format.
func (a *app) connect() (*clients, printer, error) {
	t, err := a.resolve()
	if err != nil {
		return nil, printer{}, err
	}
	return newClients(t.server, t.token), a.printer(), nil
}

func (a *app) printer() printer { return printer{w: a.stdout, format: a.output} }

// loadConfig loads the config file and warns (once) when others can read it.
func (a *app) loadConfig(path string) (*config, error) {
	if st, err := os.Stat(path); err == nil && st.Mode().Perm()&0o077 != 0 {
		a.warnOnce.Do(func() {
			fmt.Fprintf(a.stderr, "warning: %s holds admin tokens but is readable by others (mode %04o); run: chmod 600 %s\n", path, st.Mode().Perm(), path)
		})
	}
	return loadConfig(path)
}

// warnSecret tells the user a token is shown once.
func (a *app) warnSecret(what string) {
	fmt.Fprintf(a.stderr, "warning: save this %s now: it cannot be shown again.\n", what)
}

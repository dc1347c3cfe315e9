package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// envName is the environment variable of a flag: SLUICE_ and the flag's
// name upper-cased, dashes to underscores (--max-body-reads →
// SLUICE_MAX_BODY_READS). Every flag of every command has one.
func envName(flag string) string {
	return "SLUICE_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// envAliases are the older names of a few flags' variables, still read
// (after the SLUICE_<FLAG> name) so existing deployments keep working.
type envAliases map[string]string

// applyEnv sets every flag of fs that is not on the command line from
// its variable: SLUICE_<FLAG> first, then its alias. It runs before
// Parse, so a flag on the command line wins over the environment, and the
// environment over the default. Each flag's usage names its variables.
// A value the flag refuses is an error naming the variable; every such
// error is reported at once.
func applyEnv(fs *flag.FlagSet, getenv func(string) string, aliases envAliases) error {
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		name := envName(f.Name)
		names := name
		v := getenv(name)
		if alias := aliases[f.Name]; alias != "" {
			names += ", or " + alias
			if v == "" {
				name, v = alias, getenv(alias)
			}
		}
		f.Usage += " (" + names + ")"
		if v == "" {
			return
		}
		if err := f.Value.Set(v); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", name, v, err))
		}
	})
	return errors.Join(errs...)
}

// parseEnvFlags applies the environment (applyEnv), then args.
func parseEnvFlags(fs *flag.FlagSet, args []string, getenv func(string) string, aliases envAliases) error {
	if err := applyEnv(fs, getenv, aliases); err != nil {
		return err
	}
	return parseFlags(fs, args)
}

// envOr returns the environment value of name, or def.
func envOr(getenv func(string) string, name, def string) string {
	if v := getenv(name); v != "" {
		return v
	}
	return def
}

// secret reads a secret from $NAME or from the file named by $NAME_FILE
// (never from a flag, so it does not show in process listings).
func secret(getenv func(string) string, name string) (string, error) {
	v, file := getenv(name), getenv(name+"_FILE")
	if v != "" && file != "" {
		return "", fmt.Errorf("set %s or %s_FILE, not both", name, name)
	}
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("read %s_FILE: %w", name, err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	return v, nil
}

// newLogger builds the process logger: JSON (default) or text on w.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("log format %q: want json or text", format)
}

// Logging defaults.
const (
	defaultLogLevel  = "info"
	defaultLogFormat = "json"
)

// logFlags registers --log-level and --log-format (their variables come
// with every other flag's, in applyEnv).
func logFlags(fs *flag.FlagSet, defFormat string) (*string, *string) {
	level := fs.String("log-level", defaultLogLevel, "log level: debug, info, warn, error")
	format := fs.String("log-format", defFormat, "log format: json or text")
	return level, format
}

// parseFlags parses args, rejecting positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return errors.New("unexpected arguments: " + strings.Join(fs.Args(), " "))
	}
	return nil
}

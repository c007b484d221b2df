package elector

import "errors"

// ErrClosed is returned by [Elector.Run] when it is called a second time.
var ErrClosed = errors.New("elector: Run called twice")

// ErrConfig is matched by the error [Elector.Run] returns for an invalid
// lease duration or lease key.
var ErrConfig = errors.New("elector: invalid configuration")

// Package clitext holds the text rules the limitmesh commands and the
// bench they run share, each written once: how a URL is printed
// ([RedactURL]) and how a number a user typed goes into a JSON body
// ([NumberJSON]).
//
// It imports the standard library only.
package clitext
